"""Two of the CPU decode path's switches A/B, two engines in one process (issue 38 §2).

Each switch turns off one thing the batch-1 decode path does, by its environment variable:
  huge_pages  OPTKIT_HUGE_PAGES=0: the packed weights a decode step streams (the W4A8 layout of
              4-bit linears, the column-major int8 weight of a W8A8 layer or head) in 4 KiB pages
              rather than the 2 MiB pages of optkit/kernels/huge_pages.py;
  watch       OPTKIT_CPU_WATCH=0: the fused stack's per-step check that its kept weights stand
              (models/derived.py) in Python's loops rather than in C++ (optkit/kernels/cpu_watch.cpp).
This builds two engines of the same artifact in one process, one with the switch off and one as
shipped, runs one request at batch 1 on each and switches between them every 10 decode steps.
Printed per artifact: each engine's median decode step (engine.step(), decode only), the weight
bytes a step reads (bench/cpu_real_shapes.py's count) over that time, the ratio of the two, and the
read bandwidth (summing a 1 GiB float32 array with the same threads). Both engines compute the same
tokens (checked).

Usage: python bench/cpu_decode_switches.py [--switches huge_pages,watch] [--shapes smollm2-135m,gemma-3-270m]
       [--artifacts "w4a16 head int8,w4a16 head int4"] [--steps 150] [--threads 2]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/cpu_real_shapes.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WAYS = ("off", "shipped")
SWITCHES = {  # name -> (environment variable, the module and function whose cached answer it decides)
    "huge_pages": ("OPTKIT_HUGE_PAGES", "optkit.kernels.huge_pages", "unavailable_reason"),
    "watch": ("OPTKIT_CPU_WATCH", "optkit.kernels.cpu_watch", "_module"),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--switches", default=",".join(SWITCHES))
    p.add_argument("--shapes", default="smollm2-135m,gemma-3-270m")
    p.add_argument("--artifacts", default="w4a16 head int8,w4a16 head int4")
    p.add_argument("--steps", type=int, default=150, help="decode steps of each engine")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def engine_with(path: Path, switch: str, on: bool, tokens: int):
    """An engine of `path` built, prefilled and one step decoded (which packs and keeps the weights)
    with `switch` on or off."""
    import importlib

    from optkit.runtime.benchmark import BenchConfig, build_engine, random_prompts
    from optkit.runtime.sequence import SamplingParams

    variable, module, function = SWITCHES[switch]
    cached = getattr(importlib.import_module(module), function)
    os.environ[variable] = "1" if on else "0"
    cached.cache_clear()
    try:
        engine = build_engine(path, BenchConfig(batch_sizes=[1], prompt_len=64, gen_len=tokens), enforce_eager=False)
        prompt = random_prompts(4096, 1, 64, seed=0)[0]
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), "ab")
        engine.step()  # the prefill
        engine.step()  # the first decode: the fused stack gathers and keeps its weights
    finally:
        os.environ.pop(variable)
        cached.cache_clear()
    return engine


def step_times(path: Path, switch: str, steps: int) -> dict[str, float]:
    """Way -> the median decode step (seconds), the engines taking turns every 10 steps."""
    tokens = steps + 22
    engines = {way: engine_with(path, switch, way == "shipped", tokens) for way in WAYS}
    times = {way: [] for way in WAYS}
    outputs = {way: [] for way in WAYS}
    for i in range(2 * steps + 20):
        way = WAYS[(i // 10) % 2]
        start = time.perf_counter()
        for out in engines[way].step():
            outputs[way] += out.token_ids
        if i >= 20:  # the first steps warm up
            times[way].append(time.perf_counter() - start)
    shorter = min(len(tokens) for tokens in outputs.values())
    assert outputs[WAYS[0]][:shorter] == outputs[WAYS[1]][:shorter], "the two engines' tokens differ"
    return {way: statistics.median(t) for way, t in times.items()}


def main():
    args = parse_args()
    import torch
    from cpu_real_shapes import build_artifacts, build_base, decode_step_bytes, read_bandwidth

    torch.set_num_threads(args.threads)
    print(f"read bandwidth {read_bandwidth(args.threads) / 1e9:.1f} GB/s, {args.threads} threads")
    print(f"{'switch':10} {'shape':14} {'artifact':16} {'MB/step':>8} {'off':>18} {'shipped':>18} {'speed-up':>8}")
    for shape in args.shapes.split(","):
        artifacts = build_artifacts(shape, build_base(shape, print), print, llama_cpp=False)
        for switch in args.switches.split(","):
            for name in args.artifacts.split(","):
                nbytes = decode_step_bytes(artifacts[name], "float32")
                t = step_times(artifacts[name], switch, args.steps)
                cells = [f"{t[way] * 1e3:6.2f} ms {nbytes / t[way] / 1e9:4.1f} GB/s" for way in WAYS]
                print(f"{switch:10} {shape:14} {name:16} {nbytes / 1e6:8.1f} {cells[0]:>18} {cells[1]:>18} "
                      f"{t['off'] / t['shipped']:7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
