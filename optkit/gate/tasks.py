"""Multiple-choice task accuracy, scored the way lm-eval scores `acc`: the choice whose tokens
have the highest total log-probability after the context wins.

Task files are jsonl records {"context": str, "choices": [str, ...], "gold": int}; the bundled
`next_line` task is built from held-out standard-library code (eval_sets/next_line.yaml).
"""

import json
from pathlib import Path

import torch

from optkit.data.eval_sets import bundled_names, load_definition, materialize
from optkit.errors import OptkitError


def load_task(name_or_path: str) -> list[dict]:
    if name_or_path in bundled_names():
        if load_definition(name_or_path).kind != "multiple_choice":
            raise OptkitError(f"--task {name_or_path!r} is a text set, not a multiple-choice task")
        path = materialize(name_or_path)
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise OptkitError(f"--task {name_or_path!r} is neither a bundled task nor a .jsonl file")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not (0 <= int(record["gold"]) < len(record["choices"])) or not isinstance(record["context"], str):
                raise ValueError("gold out of range")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise OptkitError(f"{path} line {number}: expected {{'context', 'choices', 'gold'}} ({e})") from e
        records.append(record)
    if not records:
        raise OptkitError(f"--task {name_or_path!r} has no questions")
    return records


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Tokenize as lm-eval does: trailing whitespace of the context moves to the continuation,
    the two are encoded together, and the continuation is what follows the context's tokens."""
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole = tokenizer(stripped + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(stripped, add_special_tokens=False)["input_ids"]
    return context_ids, whole[len(context_ids) :]


def encode_task(tokenizer, records: list[dict]) -> list[tuple[list[list[int]], list[list[int]], int]]:
    """([context ids per choice], [choice ids per choice], gold) per question."""
    encoded = []
    for record in records:
        pairs = [encode_pair(tokenizer, record["context"], choice) for choice in record["choices"]]
        encoded.append(([c for c, _ in pairs], [x for _, x in pairs], int(record["gold"])))
    return encoded


@torch.inference_mode()
def choice_logprobs(model, contexts: list[list[int]], choices: list[list[int]], pad_id: int) -> torch.Tensor:
    """Σ log p(choice tokens | its context) for each choice: [num_choices]."""
    sequences = [context + choice for context, choice in zip(contexts, choices, strict=True)]
    length = max(len(s) for s in sequences)
    batch = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = torch.tensor(sequence)
    log_p = torch.log_softmax(model(batch).logits.float(), dim=-1)
    scores = []
    for row, (context, choice) in enumerate(zip(contexts, choices, strict=True)):
        positions = torch.arange(len(context) - 1, len(context) - 1 + len(choice))
        scores.append(log_p[row, positions, torch.tensor(choice)].sum())
    return torch.stack(scores)


def item_correct(model, encoded: list[tuple[list[list[int]], list[list[int]], int]], pad_id: int) -> torch.Tensor:
    """Whether the model picks the gold choice, per question: bool [num_questions] (the unit the
    gate's task intervals resample, paired with the base's answers to the same questions)."""
    picks = [int(choice_logprobs(model, c, choices, pad_id).argmax()) == gold for c, choices, gold in encoded]
    return torch.tensor(picks, dtype=torch.bool)


def accuracy(model, encoded: list[tuple[list[list[int]], list[list[int]], int]], pad_id: int) -> float:
    return item_correct(model, encoded, pad_id).double().mean().item()
