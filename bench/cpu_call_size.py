"""The W4A8 GEMV's bandwidth against the size of its calls, at batch 1 (issue 38 §2).

A decode step of a small model streams its weights in many short calls: SmolLM2-135M's 58 MB in 120
linears of 0.18-0.94 MB, each split over the threads. This times, in one process and interleaved,
  - small: a whole step's linears of a real model's shape (qkv, o, gate_up, down per layer, each
    layer its own weights, as bench/cpu_prefetch.py builds them: more bytes than the last-level cache);
  - large: about the same bytes in `--large-calls` linears of the model's hidden size (rows of
    every layer's linears pooled, split evenly),
with the same kernel, thread count and weight layout (each linear packed by cpu_w4a8.pack, in 2 MiB
pages where Linux gives them). Printed per shape and thread count: the read bandwidth (summing a 1 GiB
float32 array with the same threads, the mean of one measurement before and one after), each
side's bytes / time, the ratio of the two, and the small calls' share of the read bandwidth. A ratio
below 1 is what the call structure costs: the per-call work (activation quantization, allocations,
the threads' start and join) and each call's stream starting cold. The extra time per call is
printed beside the floor of a call from this script: the same number of calls of a 16-row linear whose
weights stay in the cache (Python's call and the kernel's fixed work; the engine's C++ stack pays
the kernel's part only).

Usage: python bench/cpu_call_size.py [--shapes smollm2-135m,gemma-3-270m] [--threads 2] [--repeats 30]
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/cpu_prefetch.py, bench/cpu_real_shapes.py


def parse_args():
    from cpu_prefetch import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--threads", type=int, default=2, help="the most threads; 1 is measured too")
    p.add_argument("--repeats", type=int, default=30, help="steps of each side per thread count; the median")
    p.add_argument("--large-calls", type=int, default=8)
    return p.parse_args()


def large_packs(shape: str, small_bytes: int, calls: int):
    """`calls` linears of K = hidden whose bytes add up to about `small_bytes` (rows a multiple of 16)."""
    from cpu_prefetch import SHAPES, random_w4

    hidden = SHAPES[shape][0]
    probe = random_w4(16, hidden, seed=0)
    bytes_per_16_rows = nbytes([probe])
    rows = 16 * max(1, round(small_bytes / calls / bytes_per_16_rows))
    return [random_w4(rows, hidden, seed=1000 + i) for i in range(calls)]


def nbytes(packs) -> int:
    return sum(p.weight.numel() + p.params.numel() * p.params.element_size() for p in packs)


def floor_packs(small):
    """One 16-row linear per call of `small`, of that call's K: the same number of calls, each reading
    a few KB that stay in the cache (one pack per distinct K)."""
    from cpu_prefetch import random_w4

    by_k = {k: random_w4(16, k, seed=0) for k in {p.in_features for p in small}}
    return [by_k[p.in_features] for p in small]


def main():
    args = parse_args()
    import torch
    from cpu_prefetch import interleaved, step_packs, w4a8_step
    from cpu_real_shapes import read_bandwidth

    from optkit.kernels import cpp_build, cpu_w4a8

    if cpu_w4a8.unavailable_reason():
        sys.exit(f"the W4A8 kernel does not run here: {cpu_w4a8.unavailable_reason()}")
    op = cpu_w4a8._linear_op()
    print(f"W4A8 on {cpp_build.ISA_NAMES[cpu_w4a8.selected_isa()]}; GB/s: weight bytes / the median step's time; "
          "per call: (small - large) / (calls - large calls), and the floor of one call from this script")  # fmt: skip
    print(f"{'shape':14} {'threads':>7} {'read':>6} {'small calls':>17} {'large calls':>17} {'small/large':>11} "
          f"{'small/read':>10} {'per call':>9} {'floor':>7}")  # fmt: skip
    for shape in args.shapes.split(","):
        small, rows = step_packs(shape)
        large = large_packs(shape, nbytes(small), args.large_calls)
        named = {"small": small, "large": large, "floor": floor_packs(small)}
        calls = {name: w4a8_step(op, packs, rows) for name, packs in named.items()}
        for threads in sorted({1, args.threads}):
            torch.set_num_threads(threads)
            before = read_bandwidth(threads)
            times = interleaved(calls, args.repeats)
            read = (before + read_bandwidth(threads)) / 2
            speed = {name: nbytes(named[name]) / times[name] for name in ("small", "large")}
            cells = [f"{len(named[n])} x {nbytes(named[n]) / len(named[n]) / 1e6:4.2f} MB {speed[n] / 1e9:5.1f}"
                     for n in ("small", "large")]  # fmt: skip
            # the large side's time scaled to the small side's bytes: what those bytes cost in long calls
            extra = times["small"] - times["large"] * nbytes(named["small"]) / nbytes(named["large"])
            per_call = extra / (len(small) - len(named["large"]))
            print(f"{shape:14} {threads:>7} {read / 1e9:6.1f} {cells[0]:>17} {cells[1]:>17} "
                  f"{speed['small'] / speed['large']:10.2f}x {speed['small'] / read:9.0%} {per_call * 1e6:6.1f} us "
                  f"{times['floor'] / len(small) * 1e6:4.1f} us")  # fmt: skip
    print("small/large below 1: what a step's many short calls cost against the same bytes in a few long ones")


if __name__ == "__main__":
    main()
