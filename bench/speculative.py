"""Output tokens/s of speculative decoding against plain decoding, measured in the same run.

Workload: "repeat this passage". Each prompt is a held-out passage of Python source followed by its
first line again, so a continuation that quotes the passage is what the prompt invites; prompt
lookup (n-gram) finds the passage, a draft model has to predict it. Every run decodes the same
requests greedily with EOS ignored (so every run produces the same number of tokens), and the bench
checks that each speculative run's tokens equal the plain run's, token for token.

Runs, at batch 1 (requests one after another) and at batch 16 (all submitted at once):
  plain decoding; n-gram speculation; draft-model speculation (--draft, default the `draft` model).
Each run is repeated (--repeats, interleaved with the others) and its fastest time kept, so that
other load on the machine does not decide the ratios. On a machine shared with other jobs, pass
--threads 1: two threads contending for busy cores can be ten times slower than one.

--num-speculative-tokens takes one k for every proposer, or one per --speculative value; by
default 16 for n-gram (it proposes k tokens only after a full 4-token match, in runs of repeated
text, where long guesses pay; after shorter matches, or after its last guess failed, it proposes
fewer) and 3 for a draft model (each proposal costs a draft forward pass).

Usage: python bench/speculative.py [--target small] [--draft draft] [--speculative ngram draft:draft]
                                   [--num-speculative-tokens 8 3] [--max-tokens 128] [--threads 1] [--json]
"""

import argparse
import json
import random
import time

import torch
from rich.console import Console
from rich.table import Table

from optkit.data.eval_sets import load_text_set
from optkit.modeldir import load_tokenizer, resolve_model_dir
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams

BATCHES = (1, 16)
DEFAULT_K = {"ngram": 16, "draft": 3}


def quoting_prompts(tokenizer, n: int, seed: int, lines: int = 12) -> list[list[int]]:
    """A passage of `lines` consecutive non-blank lines of held-out source, then its first line again."""
    rng = random.Random(seed)
    source = [line for text in load_text_set("heldout").texts for line in text.splitlines() if line.strip()]
    prompts = []
    while len(prompts) < n:
        start = rng.randrange(0, len(source) - lines)
        passage = source[start : start + lines]
        if len(passage[0].strip()) < 12:  # a first line too short to point at the passage
            continue
        prompts.append(tokenizer.encode("\n".join(passage) + "\n\n" + passage[0] + "\n"))
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = []
    for b in range(0, len(prompts), batch):
        outputs += engine.generate(prompts[b : b + batch], params)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="small")
    parser.add_argument("--draft", default="draft", help="the draft model of the default draft run")
    parser.add_argument("--speculative", nargs="+", help="proposers to run (default: ngram draft:DRAFT)")
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", help="k for all, or one per proposer")
    parser.add_argument("--requests", type=int, default=16, help="requests per batch size (a multiple of 16)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each configuration; the fastest counts")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_model_dir(args.target)
    proposers = args.speculative or ["ngram", f"draft:{args.draft}"]
    ks = args.num_speculative_tokens or [DEFAULT_K[p.partition(":")[0]] for p in proposers]
    if len(ks) not in (1, len(proposers)):
        parser.error("give one --num-speculative-tokens, or one per --speculative value")
    ks = ks * len(proposers) if len(ks) == 1 else ks
    prompts = quoting_prompts(load_tokenizer(target), args.requests, args.seed)

    configs = {"plain": EngineConfig(max_num_seqs=max(BATCHES))}
    for spec, k in zip(proposers, ks, strict=True):  # rows named "ngram k=16", "draft k=3"
        name = f"{spec.partition(':')[0]} k={k}"
        configs[name] = EngineConfig(max_num_seqs=max(BATCHES), speculative=spec, num_speculative_tokens=k)
    engines = {name: LLMEngine(target, config) for name, config in configs.items()}
    for engine in engines.values():  # warm-up: first-call costs are not throughput
        run(engine, prompts[:2], 2, 8)

    rows = []
    for batch in BATCHES:
        best: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        before = {name: engine.stats() for name, engine in engines.items()}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                seconds, outputs[name] = run(engine, prompts, batch, args.max_tokens)
                best[name] = min(seconds, best.get(name, seconds))
        for name, engine in engines.items():
            after, seconds = engine.stats(), best[name]
            tokens = sum(len(o) for o in outputs[name])
            steps = after.num_spec_steps - before[name].num_spec_steps
            drafted = after.num_spec_draft_tokens - before[name].num_spec_draft_tokens
            accepted = after.num_spec_accepted_tokens - before[name].num_spec_accepted_tokens
            rows.append(
                {
                    "batch": batch,
                    "run": name,
                    "seconds": seconds,
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                    "speedup": best["plain"] / seconds,
                    "same_tokens_as_plain": outputs[name] == outputs["plain"],
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "accepted_per_step": accepted / steps if steps else None,
                }
            )
    if args.json:
        report = {"target": args.target, "proposers": proposers, "max_tokens": args.max_tokens, "runs": rows}
        print(json.dumps(report, indent=2))
        return
    title = (
        f"target {args.target}, proposers {' '.join(proposers)}: {len(prompts)} 'repeat this passage' "
        f"requests x {args.max_tokens} tokens, {torch.get_num_threads()} threads"
    )
    table = Table(title=title)
    for column in ("batch", "run", "s", "tok/s", "vs plain", "accepted", "per step", "= plain"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            str(row["batch"]),
            row["run"],
            f"{row['seconds']:.2f}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['speedup']:.2f}x",
            "" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}",
            "" if row["accepted_per_step"] is None else f"{row['accepted_per_step']:.2f}",
            "yes" if row["same_tokens_as_plain"] else "NO",
        )
    Console().print(table)
    print("accepted: proposals the target accepted; per step: accepted per sequence decode step")


if __name__ == "__main__":
    main()
