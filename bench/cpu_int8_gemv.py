"""The int8 matrix product of a W8A8 layer at decode, side by side in one process: `torch._int_mm`
(oneDNN, the weight column-major as W8A8Linear keeps it) against optkit's int8 GEMV
(kernels/cpu_int8_gemv.py: AVX-512 VNNI, or AVX2 where the CPU has no VNNI or OPTKIT_CPU_ISA=avx2
caps it), on the vocabulary heads of real small models (an int8 `--head` is a W8A8 layer) and one
decoder matrix, at 1 to 8 rows. Both give the same int32 result
(checked here on every shape). Then the whole dynamic linear (float32 activations in and out): the
PyTorch code around the GEMV (w8a8.quantize_activations, the GEMV, the rescaling) against
`int8_linear_dynamic`, the same in one C++ call (the same bits, checked). Each figure is the median
over interleaved repeats of the mean time of a batch of calls; the ratio is the median of the ratios
within a repeat; GB/s counts the weight's bytes once per call (a weight larger than the last-level
cache is read from memory).

Usage: python bench/cpu_int8_gemv.py [--threads 2] [--rows 1,4,8] [--repeats 5]
"""

import argparse
import statistics

import torch
from cpu_w4_kernel import timed  # bench/ is the script's directory: on sys.path

SHAPES = {  # name -> (out_features N, in_features K)
    "SmolLM2-135M head": (49152, 576),
    "Gemma-3-270M head": (262144, 640),
    "Qwen3-0.6B head": (151936, 1024),
    "Gemma-3-270M gate_up": (4096, 640),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from optkit.kernels import cpu_int8_gemv

    reason = cpu_int8_gemv.unavailable_reason()
    if reason:
        raise SystemExit(f"optkit's int8 GEMV does not run here: {reason}")
    print(f"{'shape':22} {'rows':>4} {'_int_mm us':>11} {'optkit us':>10} {'GB/s':>6} {'vs _int_mm':>10}")
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        weight_t = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).t()  # column-major [K, N]
        sums = cpu_int8_gemv.weight_sums(weight_t)
        for rows in map(int, args.rows.split(",")):
            qx = torch.randint(-128, 128, (rows, k), generator=gen, dtype=torch.int8)
            assert torch.equal(cpu_int8_gemv.int8_gemv(qx, weight_t, sums), torch._int_mm(qx, weight_t))
            theirs, ours, ratios = [], [], []
            for _ in range(args.repeats):
                theirs.append(timed(lambda: torch._int_mm(qx, weight_t), 0.2))  # noqa: B023 (called at once)
                ours.append(timed(lambda: cpu_int8_gemv.int8_gemv(qx, weight_t, sums), 0.2))  # noqa: B023
                ratios.append(theirs[-1] / ours[-1])
            t_ours = statistics.median(ours)
            print(
                f"{name:22} {rows:>4} {statistics.median(theirs) * 1e6:>11.0f} {t_ours * 1e6:>10.0f} "
                f"{n * k / t_ours / 1e9:>6.1f} {statistics.median(ratios):>9.2f}x"
            )
    print(f"\n{'shape':22} {'rows':>4} {'PyTorch us':>11} {'one call us':>11} {'GB/s':>6} {'vs PyTorch':>10}")
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator().manual_seed(1)
        weight_t = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).t()
        sums, scale = cpu_int8_gemv.weight_sums(weight_t), torch.rand(n, generator=gen) / 100
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(pytorch_linear(x, weight_t, sums, scale), one_call(x, weight_t, sums, scale))
            theirs, ours, ratios = [], [], []
            for _ in range(args.repeats):
                theirs.append(timed(lambda: pytorch_linear(x, weight_t, sums, scale), 0.2))  # noqa: B023
                ours.append(timed(lambda: one_call(x, weight_t, sums, scale), 0.2))  # noqa: B023
                ratios.append(theirs[-1] / ours[-1])
            t_ours = statistics.median(ours)
            print(
                f"{name:22} {rows:>4} {statistics.median(theirs) * 1e6:>11.0f} {t_ours * 1e6:>11.0f} "
                f"{n * k / t_ours / 1e9:>6.1f} {statistics.median(ratios):>9.2f}x"
            )
    print(f"\n{args.threads} threads, torch {torch.__version__}, {cpu_int8_gemv.name()}")


def pytorch_linear(x: torch.Tensor, weight_t: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w8a8.int8_linear's PyTorch code around optkit's GEMV."""
    from optkit.kernels import cpu_int8_gemv
    from optkit.kernels.w8a8 import quantize_activations

    qx, sx = quantize_activations(x)
    return torch.mul(cpu_int8_gemv.int8_gemv(qx, weight_t, sums), sx).mul_(scale)


def one_call(x: torch.Tensor, weight_t: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from optkit.kernels import cpu_int8_gemv

    return cpu_int8_gemv.int8_linear_dynamic(x, weight_t, sums, scale, None)


if __name__ == "__main__":
    main()
