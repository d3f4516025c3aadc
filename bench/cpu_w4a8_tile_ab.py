"""The W4A8 kernel against an earlier revision of it, A/B in one process (issue 38 §2).

optkit/kernels/cpu_w4a8.cpp and its headers (the tiles, the activations' quantization) as they were
at git revision --baseline are built beside the shipped library under an operator namespace of their
own (bench/kernel_baseline.py). Both run the same one-row calls, interleaved, after their outputs are
checked equal to the bit:
  - the vocabulary projection of Gemma 3 270M (262,144 x 640, RTN 4-bit group 64, bf16 scales: 84 MB,
    read from memory at every call), on 1 and on 2 threads;
  - a 2,048 x 640 weight called 40 times in a row (655 KB, from the caches after the first call), on
    1 and on 2 threads: where the tile's arithmetic, not the memory, sets the pace.
Printed per case: each build's bytes / time (GB/s), the median of the per-repeat ratios (> 1: the
shipped tiles faster), and the read bandwidth (summing a 1 GiB float32 array with the same threads).

Usage: python bench/cpu_w4a8_tile_ab.py --baseline REV [--repeats 9] [--rows 1]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/cpu_prefetch.py, cpu_real_shapes.py, kernel_baseline.py

# name -> (out features, in features, calls in a row, threads)
CASES = {
    "Gemma 3 head, 1 thread": (262144, 640, 1, 1),
    "Gemma 3 head, 2 threads": (262144, 640, 1, 2),
    "2,048 x 640 cached, 1 thread": (2048, 640, 40, 1),
    "2,048 x 640 cached, 2 threads": (2048, 640, 40, 2),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a git revision whose W4A8 kernel to time beside the shipped one")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--rows", type=int, default=1, help="rows of the input (1: a decode step at batch 1)")
    return p.parse_args()


def baseline_linear(revision: str):
    """cpu_w4a8.cpp's linear as it was at `revision`."""
    import torch
    from kernel_baseline import build_at

    return getattr(torch.ops, build_at(revision, "cpu_w4a8.cpp", "optkit_w4a8")).linear.default


def main():
    args = parse_args()
    import torch
    from cpu_prefetch import random_w4
    from cpu_real_shapes import read_bandwidth

    from optkit.kernels import cpp_build, cpu_w4a8

    if cpu_w4a8.unavailable_reason():
        sys.exit(f"the W4A8 kernel does not run here: {cpu_w4a8.unavailable_reason()}")
    builds = {"shipped": torch.ops.optkit_w4a8.linear.default, "baseline": baseline_linear(args.baseline)}
    isa = cpu_w4a8.selected_isa()
    print(f"W4A8 tiles on {cpp_build.ISA_NAMES[isa]}, {args.rows} row(s) a call; baseline {args.baseline}")
    print(f"{'case':30} {'read GB/s':>9} {'baseline GB/s':>13} {'shipped GB/s':>12} {'speed-up':>8}")
    for case, (n, k, calls, threads) in CASES.items():
        torch.set_num_threads(threads)
        packed = random_w4(n, k, seed=n)
        x = torch.randn(args.rows, k, generator=torch.Generator().manual_seed(k))

        def run(op, packed=packed, x=x, calls=calls):
            p = packed
            return [op(x, p.weight, p.params, None, p.out_features, p.group_size, isa) for _ in range(calls)][-1]

        outputs = {name: run(op) for name, op in builds.items()}
        assert torch.equal(outputs["shipped"], outputs["baseline"]), f"{case}: the two builds' outputs differ"
        times = {name: [] for name in builds}
        for _ in range(args.repeats):
            for name, op in builds.items():
                start = time.perf_counter()
                run(op)
                times[name].append((time.perf_counter() - start) / calls)
        nbytes = packed.weight.numel() + packed.params.numel() * packed.params.element_size()
        speed = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
        ratio = statistics.median(b / s for b, s in zip(times["baseline"], times["shipped"], strict=True))
        bandwidth = read_bandwidth(threads) / 1e9
        print(f"{case:30} {bandwidth:>9.1f} {speed['baseline']:>13.1f} {speed['shipped']:>12.1f} {ratio:>7.2f}x")


if __name__ == "__main__":
    main()
