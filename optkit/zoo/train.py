"""Train a reference model from scratch on the standard library (deterministic, CPU-friendly)."""

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from optkit.artifacts import atomic_output_dir
from optkit.cache import cache_dir
from optkit.data.corpus import read_texts
from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.progress import progress_bar
from optkit.zoo.specs import VOCAB_SIZE, ZooSpec
from optkit.zoo.tokenizer import train_tokenizer


@dataclass(frozen=True)
class BuildResult:
    path: Path
    num_parameters: int
    steps: int
    heldout_perplexity: float
    seconds: float


def reference_tokenizer(train_texts: list[str]) -> PreTrainedTokenizerFast:
    """The tokenizer every reference model shares, trained once per corpus and cached."""
    digest = hashlib.sha256("".join(train_texts).encode()).hexdigest()[:16]
    path = cache_dir("tokenizers") / f"stdlib-bpe{VOCAB_SIZE}-{digest}"
    if not (path / "tokenizer.json").exists():
        with atomic_output_dir(path, overwrite=True) as tmp:
            train_tokenizer(train_texts, VOCAB_SIZE).save_pretrained(tmp)
    return PreTrainedTokenizerFast.from_pretrained(path)


def learning_rate(step: int, spec: ZooSpec, total_steps: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return spec.learning_rate * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, total_steps - spec.warmup_steps)
    return spec.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token NLL) over token windows [N, T]."""
    total_nll, total_tokens = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


def build_reference_model(
    spec: ZooSpec, out_dir: Path, *, steps: int | None = None, overwrite: bool = True
) -> BuildResult:
    """Train `spec` for `steps` (default: the spec's) and save it, bf16 safetensors, to `out_dir`."""
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    train_texts = read_texts("train")
    tokenizer = reference_tokenizer(train_texts)
    windows = pack_windows(tokenize_stream(tokenizer, train_texts), spec.seq_len)
    heldout = pack_windows(tokenize_stream(tokenizer, load_text_set("heldout").texts), spec.seq_len)

    config = LlamaConfig(**spec.llama_config_kwargs(len(tokenizer), tokenizer.eos_token_id))
    model = LlamaForCausalLM(config)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim != 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    total_steps = steps if steps is not None else spec.steps
    generator = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(windows), generator=generator)
    cursor = 0
    model.train()
    with progress_bar() as bar:
        task = bar.add_task(f"train {spec.name}", total=total_steps, info="")
        for step in range(total_steps):
            if cursor + spec.batch_size > len(order):
                order, cursor = torch.randperm(len(windows), generator=generator), 0
            batch = windows[order[cursor : cursor + spec.batch_size]]
            cursor += spec.batch_size
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, spec, total_steps)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_per_s = (step + 1) * batch.numel() / (time.perf_counter() - start)
            bar.update(task, advance=1, info=f"loss {loss.item():.3f}  {tokens_per_s:,.0f} tok/s")

    model.eval()
    heldout_ppl = perplexity(model, heldout)
    model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return BuildResult(out_dir, model.num_parameters(), total_steps, heldout_ppl, time.perf_counter() - start)
