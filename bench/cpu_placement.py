"""Where the machine has put the two CPUs a decode step runs on, sampled over time (issue 38 §2).

On a shared virtual machine the host moves its vCPUs: the two may be SMT siblings of one core, two
cores sharing an L3, or cores on different L3s (chiplets). Each placement has its own memory system:
across L3s the sum of a 1 GiB array reads the most (two memory paths), and every hand-off between
the two threads costs the most (a cache line's round trip several times longer). A batch-1 decode
step hands data between its threads ~150 times (each linear's split outputs, each attention), so
its share of the read bandwidth depends on the placement, not only on the kernels: this prints
the two together so that a run's share can be read against the placement it ran in.

For --seconds, one sample after another with --interval seconds between: the core-to-core round
trip (two threads pinned to the first two CPUs this process may run on pass one cache line back and
forth: bench/cpu_round_trip.cpp) and the read bandwidth (bench/cpu_real_shapes.py's: summing a 1 GiB
float32 array with --threads threads). Printed: the samples grouped by round trip (below 45 ns: one
core; 45-150: one L3; above: across L3s), each group's count and its read bandwidth's median and
range.

Usage: python bench/cpu_placement.py [--seconds 60] [--interval 0.2] [--threads 2] [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/cpu_real_shapes.py

# round trip (ns) -> placement: the upper bounds of one core's and one L3's (AMD EPYC, Intel Xeon: SMT
# siblings ~20-40 ns, cores of one L3 ~50-100 ns, across L3s or sockets ~200-400 ns)
PLACEMENTS = (("one core (SMT siblings)", 45.0), ("one L3", 150.0), ("across L3s", float("inf")))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def round_trip_ns(rounds: int = 20000, batches: int = 5) -> float | None:
    """The median round trip (ns) of one cache line between the first two CPUs this process may run
    on; None where there are fewer than two or a thread cannot be pinned."""
    import torch

    from optkit.kernels import cpp_build

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    if not hasattr(torch.ops.optkit_bench_round_trip, "core_round_trip_ns"):
        reason = cpp_build.load(ROOT / "bench" / "cpu_round_trip.cpp", "optkit_bench_round_trip")
        if reason:
            sys.exit(f"cannot build bench/cpu_round_trip.cpp: {reason}")
    ns = torch.ops.optkit_bench_round_trip.core_round_trip_ns(cpus[0], cpus[1], rounds, batches)
    return None if ns < 0 else ns


def placement(ns: float | None) -> str:
    if ns is None:
        return "unknown"
    return next(name for name, bound in PLACEMENTS if ns < bound)


def by_placement(samples: list[dict]) -> list[tuple[str, list[dict]]]:
    """The samples (each with a "round_trip_ns") grouped by placement, in PLACEMENTS' order, empty
    groups left out."""
    groups = [(name, [s for s in samples if placement(s["round_trip_ns"]) == name]) for name, _ in PLACEMENTS]
    return [(name, group) for name, group in groups if group]


def main():
    args = parse_args()
    from cpu_real_shapes import read_bandwidth

    samples = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        samples.append({"round_trip_ns": round_trip_ns(), "read_bytes_per_s": read_bandwidth(args.threads, repeats=1)})
        time.sleep(args.interval)
    print(f"{len(samples)} samples over {args.seconds:.0f} s, {args.threads} threads for the read")
    print(f"{'placement':24} {'round trip':>10} {'samples':>7} {'read GB/s':>9} {'range':>11}")
    for name, group in by_placement(samples):
        reads = [s["read_bytes_per_s"] / 1e9 for s in group]
        trip = statistics.median(s["round_trip_ns"] for s in group)
        print(f"{name:24} {trip:>7.0f} ns {len(group):>7} {statistics.median(reads):>9.1f} "
              f"{min(reads):>5.1f}-{max(reads):<5.1f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
