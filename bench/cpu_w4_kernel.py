"""The CPU W4 kernels alone, side by side in one process (issue 20): for a 2048x2048 weight and the four
linears of bench/cpu_decode.py's shape (a) after fusion (qkv 2304x768, o 768x768, gate_up 4096x768,
down 768x2048), RTN 4-bit group 64, at M rows: fp32 `F.linear` on the dequantized weight, PyTorch's
int4 kernel (`aten._weight_int4pack_mm_for_cpu`, bf16 activations: kernels/cpu_int4.py), and optkit's
W4A8 kernel (kernels/cpu_w4a8.py) on AVX-512 VNNI and on AVX2. Each figure is the median over
interleaved repeats of the mean time of a batch of calls; ratios are medians of the ratios within a
repeat.

Usage: python bench/cpu_w4_kernel.py [--threads 1] [--rows 1,16] [--repeats 5]
"""

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kernels.test_packed_int.random_quantized

SHAPES = {"2048x2048": (2048, 2048), "qkv": (2304, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--group-size", type=int, default=64)
    return p.parse_args()


def timed(fn, seconds: float = 0.05) -> float:
    """Mean seconds per call over a batch of calls lasting about `seconds`."""
    fn()
    start, calls = time.perf_counter(), 0
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed > seconds:
            return elapsed / calls


def with_isa(isa: str, fn):
    from optkit.kernels import cpu_w4a8

    def run():
        os.environ["OPTKIT_CPU_ISA"] = isa
        cpu_w4a8.selected_isa.cache_clear()
        return fn()

    return run


def measure(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each run, `repeats` times, the runs' order rotating between repeats."""
    samples = {key: [] for key in runs}
    for r in range(repeats):
        for key in list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]:
            samples[key].append(timed(runs[key]))
    return samples


def table_row(label: str, rows: int, samples: dict[str, list[float]]) -> str:
    def us(key: str) -> str:
        return f"{statistics.median(samples[key]) * 1e6:.0f}" if key in samples else "-"

    def ratio(key: str, against: str) -> str:
        if key not in samples:
            return "-"
        return f"{statistics.median(a / b for a, b in zip(samples[against], samples[key], strict=True)):.2f}x"

    cells = [label, str(rows), us("fp32"), us("aten"), us("vnni"), us("avx2"),
             ratio("vnni", "aten"), ratio("vnni", "fp32"), ratio("avx2", "fp32")]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    args = parse_args()
    import torch
    import torch.nn.functional as F

    from optkit.kernels import cpu_int4, cpu_w4a8
    from optkit.weights.quantized import QuantizedWeight
    from optkit.weights.schemes import WeightScheme

    torch.set_num_threads(args.threads)
    reason = cpu_w4a8.unavailable_reason()
    if reason:
        sys.exit(f"error: the W4A8 kernel does not run here: {reason}")
    vnni = torch.ops.optkit_w4a8.cpu_isa() == 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), group {args.group_size}, "
          f"W4A8 on {'AVX-512 VNNI and AVX2' if vnni else 'AVX2'}")  # fmt: skip
    print("| weight [N, K] | rows | fp32 us | aten int4 us | w4a8 VNNI us | w4a8 AVX2 us "
          "| VNNI vs aten | VNNI vs fp32 | AVX2 vs fp32 |")  # fmt: skip
    print("|" + "---|" * 9)
    gen = torch.Generator().manual_seed(0)
    scheme = WeightScheme(bits=4, group_size=args.group_size)
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            groups = k // args.group_size
            q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
            scale = torch.rand(n, groups, generator=gen) / 100
            qw = QuantizedWeight(q, scale, torch.zeros(n, groups, dtype=torch.int8), scheme)
            weight = qw.dequantize(torch.float32)
            aten = cpu_int4.pack(qw.q, qw.scale, qw.zero_point, 4)
            w4a8 = cpu_w4a8.pack(qw.q, qw.scale, qw.zero_point, 4)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen)
                runs = {
                    "fp32": functools.partial(F.linear, x, weight),
                    "aten": functools.partial(cpu_int4.int4_linear, x, aten),
                    "vnni": with_isa("", functools.partial(cpu_w4a8.w4a8_linear, x, w4a8)),
                    "avx2": with_isa("avx2", functools.partial(cpu_w4a8.w4a8_linear, x, w4a8)),
                }
                if not vnni:
                    del runs["vnni"]
                print(table_row(f"{name} [{n}, {k}]", rows, measure(runs, args.repeats)), flush=True)
    os.environ.pop("OPTKIT_CPU_ISA", None)


if __name__ == "__main__":
    main()
