"""The weight-stream prefetch of the CPU decode kernels, on and off in one process (issue 38 §2).

optkit/kernels/cpu_w4a8.cpp and cpu_int8_gemv.cpp ask for the weight bytes kPrefetchBytes ahead of
their loads. This builds each library twice from its source, as shipped and with kPrefetchBytes = 0
(a prefetch of the line about to be loaded: none), under its own operator namespace, and times both
on the same tensors, interleaved:
  - W4A8 at batch 1 (one row) over a whole decode step's linears of a real model's shape, each layer
    its own weights (qkv, o, gate_up, down; RTN 4-bit group 64, bf16 scales): more bytes than the
    last-level cache, so every call streams from memory as in serving;
  - the int8 head GEMV (kernels/cpu_int8_gemv.cpp) of the same shape's vocabulary, one row.
Printed: the median time of a step (or head call) of each build, its bytes / time, the ratio of the
two builds, and the read bandwidth (summing a 1 GiB float32 array with the same threads).

Usage: python bench/cpu_prefetch.py [--shapes smollm2-135m,gemma-3-270m] [--threads 2] [--repeats 40]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/cpu_real_shapes.py

# hidden, MLP, q|k|v outputs, layers, vocabulary (bench/cpu_real_shapes.py's configs)
SHAPES = {"smollm2-135m": (576, 1536, 960, 30, 49152), "gemma-3-270m": (640, 2048, 1536, 18, 262144)}
KERNELS = {"w4a8": ("cpu_w4a8.cpp", "optkit_w4a8", "linear"), "int8": ("cpu_int8_gemv.cpp", "optkit_int8_gemv", "gemv")}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    return p.parse_args()


def build(kernel: str, prefetch: bool, scratch: Path):
    """The kernel's operator from its source, as shipped or with its prefetch distance set to 0."""
    import torch

    from optkit.kernels import cpp_build

    filename, namespace, op = KERNELS[kernel]
    source = (ROOT / "optkit" / "kernels" / filename).read_text()
    tag = f"{namespace}_bench_{'pf' if prefetch else 'nopf'}"
    shipped = "constexpr int kPrefetchBytes = 4096;"
    assert shipped in source, f"{filename} no longer declares {shipped!r}: update this bench"
    source = source.replace(f"TORCH_LIBRARY({namespace},", f"TORCH_LIBRARY({tag},")
    if not prefetch:
        source = source.replace(shipped, "constexpr int kPrefetchBytes = 0;")
    path = scratch / f"{tag}.cpp"
    path.write_text(source)
    reason = cpp_build.load(path, tag)
    if reason:
        sys.exit(f"cannot build {filename}: {reason}")
    return getattr(getattr(torch.ops, tag), op).default


def random_w4(n: int, k: int, seed: int):
    import torch

    from optkit.kernels import cpu_w4a8

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // 64, generator=gen) * 0.01 + 1e-3).bfloat16().float()
    return cpu_w4a8.pack(q, scale, torch.zeros(n, k // 64, dtype=torch.int8), 4)


def interleaved(calls: dict, repeats: int) -> dict[str, float]:
    """Build name -> median seconds of its call, the builds run in turn `repeats` times."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts[2:]) for name, ts in times.items()}


def step_packs(shape: str):
    """A decode step's W4A8 linears of `shape` (qkv, o, gate_up, down per layer, each layer its own
    weights): (packs, rows) with rows[K] a one-row input of K columns."""
    import torch

    hidden, mlp, qkv, layers, _ = SHAPES[shape]
    shapes = [(qkv, hidden), (hidden, hidden), (2 * mlp, hidden), (hidden, mlp)]
    packs = [random_w4(n, k, seed=4 * layer + i) for layer in range(layers) for i, (n, k) in enumerate(shapes)]
    return packs, {k: torch.randn(1, k) for k in (hidden, mlp)}


def w4a8_step(op, packs, rows):
    from optkit.kernels import cpu_w4a8

    isa = cpu_w4a8.selected_isa()

    def step():
        for p in packs:
            op(rows[p.in_features], p.weight, p.params, None, p.out_features, p.group_size, isa)

    return step


def head_call(op, row, head):
    """One int8 GEMV of `row` by `head`, as kernels/cpu_int8_gemv.py calls it (each row's sum given)."""
    import torch

    sums = head.sum(1, dtype=torch.int32)
    return lambda: op(row, head, sums)


def main():
    args = parse_args()
    import torch
    from cpu_real_shapes import read_bandwidth

    from optkit.kernels import cpp_build, cpu_int8_gemv, cpu_w4a8

    torch.set_num_threads(args.threads)
    if cpu_w4a8.unavailable_reason():
        sys.exit(f"the W4A8 kernel does not run here: {cpu_w4a8.unavailable_reason()}")
    with tempfile.TemporaryDirectory() as scratch:
        ops = {(k, pf): build(k, pf, Path(scratch)) for k in KERNELS for pf in (True, False)}
    head_runs = not cpu_int8_gemv.unavailable_reason()
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} threads; "
          f"W4A8 on {cpp_build.ISA_NAMES[cpu_w4a8.selected_isa()]}")  # fmt: skip
    print(f"{'shape':14} {'kernel':18} {'MB':>6} {'no prefetch':>12} {'prefetch':>10} {'GB/s':>11} {'speed-up':>9}")
    for shape in args.shapes.split(","):
        hidden, _, _, _, vocab = SHAPES[shape]
        packs, rows = step_packs(shape)
        runs = {"W4A8 step, batch 1": (
            sum(p.weight.numel() + p.params.numel() * p.params.element_size() for p in packs),
            {pf: w4a8_step(ops["w4a8", pf], packs, rows) for pf in (True, False)},
        )}  # fmt: skip
        if head_runs:
            head = torch.randint(-127, 128, (vocab, hidden), dtype=torch.int8)
            row = torch.randint(-127, 128, (1, hidden), dtype=torch.int8)
            runs["int8 head, 1 row"] = (
                head.numel(),
                {pf: head_call(ops["int8", pf], row, head) for pf in (True, False)},
            )
        for kernel, (nbytes, calls) in runs.items():
            t = interleaved(calls, args.repeats)
            speeds = f"{nbytes / t[False] / 1e9:4.1f}->{nbytes / t[True] / 1e9:4.1f}"
            print(f"{shape:14} {kernel:18} {nbytes / 1e6:6.1f} {t[False] * 1e3:9.3f} ms {t[True] * 1e3:7.3f} ms "
                  f"{speeds} {t[False] / t[True]:8.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
