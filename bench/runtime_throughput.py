"""Output tokens/s of the bundled runtime against `transformers` `generate`, measured in one run.

64 requests of mixed prompt (16-256 tokens) and output (16-128 tokens) lengths, greedy, run:
  1. through `transformers` `generate` one request at a time,
  2. through `generate` in left-padded static batches of 16 (each batch runs to its longest output),
  3. through optkit's engine, all submitted at once (continuous batching, paged KV cache).
Every run produces the same useful tokens (each request's own output length; EOS is ignored), so
tokens/s compare directly. Prints the ratios and the engine's TTFT / TPOT p50/p95/p99.

Usage: python bench/runtime_throughput.py [--model small] [--requests 64] [--json]
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
from optkit.runtime.benchmark import percentiles, timed_generate
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams

STATIC_BATCH = 16


def make_requests(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs cut from the held-out text."""
    rng = random.Random(seed)
    ids = tokenizer.encode("\n".join(load_text_set("heldout").texts))
    requests = []
    for _ in range(n):
        prompt_len, output_len = rng.randint(16, 256), rng.randint(16, 128)
        start = rng.randrange(0, len(ids) - prompt_len)
        requests.append((ids[start : start + prompt_len], output_len))
    return requests


def hf_model(path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every request produces exactly its output length
    return model


@torch.inference_mode()
def run_hf_one_by_one(model, requests) -> float:
    start = time.perf_counter()
    for prompt, output_len in requests:
        model.generate(torch.tensor([prompt]), max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    return time.perf_counter() - start


@torch.inference_mode()
def run_hf_static_batches(model, requests, pad_id: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(requests), STATIC_BATCH):
        batch = requests[b : b + STATIC_BATCH]
        width = max(len(p) for p, _ in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return time.perf_counter() - start


def run_engine(engine: LLMEngine, requests) -> tuple[float, list[float], list[float]]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    wall, start, first, last = timed_generate(engine, [p for p, _ in requests], params)
    ttft = [f - start for f in first]
    tpot = [(lt - f) / (n - 1) for f, lt, (_, n) in zip(first, last, requests, strict=True)]
    return wall, ttft, tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    path = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(path)
    requests = make_requests(tokenizer, args.requests, args.seed)
    tokens = sum(n for _, n in requests)

    engine = LLMEngine(path, EngineConfig(max_num_seqs=64))
    run_engine(engine, requests[:4])  # warm-up: first-call costs are not throughput
    model = hf_model(path)
    run_hf_one_by_one(model, requests[:2])

    results = {}
    results["transformers, one at a time"] = run_hf_one_by_one(model, requests)
    results[f"transformers, static batches of {STATIC_BATCH}"] = run_hf_static_batches(
        model, requests, tokenizer.pad_token_id or 0
    )
    engine_wall, ttft, tpot = run_engine(engine, requests)
    results["optkit engine"] = engine_wall
    rows = {name: {"seconds": s, "tokens_per_s": tokens / s} for name, s in results.items()}
    base_one, base_batch = (rows[k]["tokens_per_s"] for k in list(rows)[:2])
    for row in rows.values():
        row["vs_one_at_a_time"] = row["tokens_per_s"] / base_one
        row["vs_static_batches"] = row["tokens_per_s"] / base_batch
    latency = {"ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot)}
    if args.json:
        print(
            json.dumps({"requests": len(requests), "output_tokens": tokens, "runs": rows, "engine": latency}, indent=2)
        )
        return
    table = Table(
        title=f"{args.model}: {len(requests)} requests, {tokens} output tokens, {torch.get_num_threads()} threads"
    )
    for column in ("run", "s", "output tok/s", "vs one at a time", f"vs batches of {STATIC_BATCH}"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, row in rows.items():
        table.add_row(
            name,
            f"{row['seconds']:.2f}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['vs_one_at_a_time']:.2f}x",
            f"{row['vs_static_batches']:.2f}x",
        )
    console = Console()
    console.print(table)
    lat = Table("engine latency", "p50 ms", "p95 ms", "p99 ms", title="optkit engine, all requests at once")
    for name, values in (("time to first token", latency["ttft_s"]), ("time per output token", latency["tpot_s"])):
        lat.add_row(name, *(f"{values[p] * 1000:.1f}" for p in ("p50", "p95", "p99")))
    console.print(lat)


if __name__ == "__main__":
    main()
