"""fp32 linears on the CPU: PyTorch's `F.linear` (MKL) against kernels/cpu_fp32.py's oneDNN inner
product over the weight packed once, A/B in one process, at the row counts of decode steps and
prefills.

Per shape, the four linears of one decoder layer (q|k|v, o, gate|up, down; random fp32 weights) at
each row count: both ways alternate within each repeat; printed are the layer's four calls' summed
median time each way and the ratio (> 1: oneDNN faster), and whether PackedFp32Linear takes the packed
weight at that row count (up to PACKED_ROWS) or F.linear on the weight unpacked for the call.
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
    print(f"threads {args.threads}; PACKED_ROWS {cpu_fp32.PACKED_ROWS}; CPU vendor {cpu_fp32.cpu_vendor() or '?'}")
    print(f"{'shape':8} {'rows':>5} {'MKL ms':>8} {'oneDNN ms':>9} {'ratio':>6}  path")
    generator = torch.Generator().manual_seed(0)
    for shape, linears in SHAPES.items():
        weights = [torch.randn(n, k, generator=generator) * 0.05 for k, n in linears]
        packed = [cpu_fp32.PackedFp32Linear(w) for w in weights]
        for rows in rows_list:
            inputs = [torch.randn(rows, k, generator=generator) for k, _ in linears]
            mkl, onednn = [], []
            for r in range(args.repeats):
                ways = [(mkl, [lambda x, w=w: F.linear(x, w) for w in weights]), (onednn, packed)]
                for times, calls in ways if r % 2 == 0 else ways[::-1]:
                    times.append(sum(seconds(call, x) for call, x in zip(calls, inputs, strict=True)))
            a, b = statistics.median(mkl), statistics.median(onednn)
            path = "packed" if rows <= cpu_fp32.PACKED_ROWS else "F.linear, unpacked"
            print(f"{shape:8} {rows:>5} {a * 1e3:>8.3f} {b * 1e3:>9.3f} {a / b:>5.2f}x  {path}")


if __name__ == "__main__":
    main()
