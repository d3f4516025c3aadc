"""A bf16 linear on an AVX2 CPU, side by side in one process: fp32's `F.linear` (the baseline), bf16's
`F.linear` (ATen/oneDNN, what a bf16 model ran before), optkit's bf16 GEMV (kernels/cpu_bf16_gemv.py)
and fp32's GEMM on the weight widened for the call (its path past UPCAST_ROWS rows), on decoder and
head matrices of real small models, from 1 to 256 rows. Each figure is the median over interleaved
repeats of the mean time of a batch of calls; ratios are medians of the ratios within a repeat (> 1:
faster than fp32). GB/s counts the bf16 weight's bytes once per call. The kernel's result is checked
against float64 sums of the same bf16 values (one bf16 rounding and fp32's sum-order error apart).

Usage: python bench/cpu_bf16_gemv.py [--threads 2] [--rows 1,4,16,64,128,256] [--repeats 5]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from cpu_w4_kernel import timed  # bench/ is the script's directory: on sys.path

SHAPES = {  # name -> (out_features N, in_features K)
    "Llama 768 qkv": (2304, 768),
    "Llama 768 down": (768, 2048),
    "SmolLM2-135M gate_up": (3072, 576),
    "SmolLM2-135M head": (49152, 576),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,16,64,128,256")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from optkit.kernels import cpu_bf16_gemv

    reason = cpu_bf16_gemv.unavailable_reason()
    if reason:
        raise SystemExit(f"optkit's bf16 GEMV does not run here: {reason}")
    op = cpu_bf16_gemv._linear_op()
    header = f"{'shape':22} {'rows':>4} {'fp32 us':>9} {'bf16 us':>9} {'optkit us':>9} {'upcast us':>9}"
    print(header + f" {'GB/s':>6} {'bf16/fp32':>9} {'optkit/fp32':>11} {'upcast/fp32':>11}")
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(n, k, generator=gen)
        weight_bf16 = weight.bfloat16()
        weight_wide = weight_bf16.float()
        for rows in map(int, args.rows.split(",")):
            x_bf16 = torch.randn(rows, k, generator=gen).bfloat16()
            x = x_bf16.float()
            exact = F.linear(x.double(), weight_wide.double())
            sum_order = k * 2**-24 * F.linear(x.double().abs(), weight_wide.double().abs())  # fp32 sums' error
            got = op(x_bf16, weight_bf16, None).double()
            assert (got - exact).abs().le(exact.abs() * 2**-8 + sum_order).all(), name
            runs = {
                "fp32": lambda: F.linear(x, weight),  # noqa: B023 (called at once)
                "bf16": lambda: F.linear(x_bf16, weight_bf16),  # noqa: B023
                "optkit": lambda: op(x_bf16, weight_bf16, None),  # noqa: B023
                "upcast": lambda: F.linear(x_bf16.float(), weight_bf16.float()).bfloat16(),  # noqa: B023
            }
            times = {run: [] for run in runs}
            for _ in range(args.repeats):
                for run, fn in runs.items():
                    times[run].append(timed(fn, 0.2))
            ratio = {
                run: statistics.median(f / t for f, t in zip(times["fp32"], times[run], strict=True)) for run in runs
            }
            median = {run: statistics.median(t) for run, t in times.items()}
            gbs = weight_bf16.numel() * 2 / median["optkit"] / 1e9
            print(
                f"{name:22} {rows:>4} {median['fp32'] * 1e6:>9.0f} {median['bf16'] * 1e6:>9.0f} "
                f"{median['optkit'] * 1e6:>9.0f} {median['upcast'] * 1e6:>9.0f} {gbs:>6.1f} "
                f"{ratio['bf16']:>8.2f}x {ratio['optkit']:>10.2f}x {ratio['upcast']:>10.2f}x"
            )


if __name__ == "__main__":
    main()
