"""fp32 linears on the CPU: PyTorch's `F.linear` (MKL) against kernels/cpu_fp32.py's PackedFp32Linear
(oneDNN's inner product over the weight packed once into its blocked layout) and against oneDNN's
inner product over the plain row-major weight, A/B in one process, at the row counts of decode steps
and prefill chunks.

Per shape, the four linears of one decoder layer (q|k|v, o, gate|up, down; random fp32 weights) at
each row count: the three ways rotate within each repeat; printed are the layer's four calls' summed
median times and the ratios against MKL (> 1: faster than MKL).
  a        bench/cpu_decode.py's shape (a): hidden 768, MLP 2048, 12 heads of 64
  smollm2  hidden 576, MLP 1536, 9 heads / 3 KV heads of 64

Usage: python bench/cpu_fp32_linear.py [--threads 2] [--rows 1,4,16,32,64,256,640] [--repeats 7]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # (in_features, out_features) of q|k|v, o, gate|up, down
    "a": [(768, 2304), (768, 768), (768, 4096), (2048, 768)],
    "smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576)],
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,16,32,64,256,640")
    p.add_argument("--repeats", type=int, default=7)
    return p.parse_args()


def seconds(call, x, budget_s: float = 0.05) -> float:
    """Seconds a call of call(x), over enough calls to fill about budget_s."""
    call(x)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < budget_s:
        call(x)
        n += 1
    return (time.perf_counter() - start) / n


def main():
    import torch
    import torch.nn.functional as F

    from optkit.kernels import cpu_fp32

    args = parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}; CPU vendor {cpu_fp32.cpu_vendor() or '?'}")
    print(f"{'shape':8} {'rows':>5} {'MKL ms':>8} {'packed ms':>9} {'ratio':>6} {'plain ms':>8} {'ratio':>6}")
    generator = torch.Generator().manual_seed(0)
    pointwise = torch.ops.mkldnn._linear_pointwise
    for shape, linears in SHAPES.items():
        weights = [torch.randn(n, k, generator=generator) * 0.05 for k, n in linears]
        packed = [cpu_fp32.PackedFp32Linear(w) for w in weights]
        for rows in rows_list:
            inputs = [torch.randn(rows, k, generator=generator) for k, _ in linears]
            ways = {
                "mkl": [lambda x, w=w: F.linear(x, w) for w in weights],
                "packed": packed,
                "plain": [lambda x, w=w: pointwise(x, w, None, "none", [], "") for w in weights],
            }
            times = {name: [] for name in ways}
            for r in range(args.repeats):
                order = list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]  # rotate
                for name in order:
                    times[name].append(sum(seconds(call, x) for call, x in zip(ways[name], inputs, strict=True)))
            mkl, blocked, row_major = (statistics.median(times[name]) for name in ways)
            print(
                f"{shape:8} {rows:>5} {mkl * 1e3:>8.3f} {blocked * 1e3:>9.3f} {mkl / blocked:>5.2f}x"
                f" {row_major * 1e3:>8.3f} {mkl / row_major:>5.2f}x"
            )


if __name__ == "__main__":
    main()
