"""The int8 matrix product of a W8A8 layer at decode (a few rows) on AVX-512 VNNI and AVX2 CPUs, in
optkit's C++ (cpu_int8_gemv.cpp): the same int32 result as `torch._int_mm`, so every output is
bit-identical.

Why: at one row oneDNN's int8 GEMM reads a 49,152 x 576 int8 head at a third of the bandwidth a
decode step gets elsewhere, and on a CPU without VNNI (AMD Zen 3) a 262,144-row head at a sixth
(bench/cpu_int8_gemv.py); this kernel streams each weight row once, with `vpdpbusd` on AVX-512 VNNI
(unsigned x signed bytes, so the activations go in shifted by 128 and each row's weight sum takes
the shift back out) or, on AVX2, the weights widened to int16 and `vpmaddwd` (cpu_int8_gemv.cpp).
The instruction set follows cpuid, capped to AVX2 by OPTKIT_CPU_ISA=avx2 or ATEN_CPU_CAPABILITY=avx2.
It takes 1 to `max_rows()` rows: 8 with VNNI, any number on AVX2 (in passes of 8 rows: there oneDNN's
int8 GEMM is 18-44x slower from 4 to 256 rows); more rows, CPUs without AVX2 and a failed build keep
`torch._int_mm`. `int8_linear_dynamic` is a dynamic W8A8 linear (w8a8.int8_linear) in one call, the
PyTorch code's bits: at a decode step the ~10 ATen calls around the product (quantizing the
activations, rescaling the int32 result) cost more than a small vocabulary's product itself.
Built at first use into $OPTKIT_CACHE/kernels (kernels/cpp_build.py).
"""

import functools
from pathlib import Path

import torch

from optkit.kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_int8_gemv.cpp")


@functools.cache
def unavailable_reason() -> str:
    """An empty string when the kernel runs here; otherwise why not (checked once per process)."""
    reason = cpp_build.load(SOURCE, "optkit_int8_gemv")
    if not reason and torch.ops.optkit_int8_gemv.cpu_isa() < 1:
        return "this CPU has no AVX2"
    return reason


@functools.cache
def selected_isa() -> int:
    """1 (AVX2) or 2 (AVX-512 VNNI): the CPU's best, capped by OPTKIT_CPU_ISA / ATEN_CPU_CAPABILITY=avx2
    (callers check unavailable_reason() first)."""
    return cpp_build.capped_isa(int(torch.ops.optkit_int8_gemv.cpu_isa()))


def name() -> str:
    return f"optkit C++ int8 GEMV ({cpp_build.ISA_NAMES[selected_isa()]})"


def max_rows() -> int:
    """The most rows a call takes: 8 with VNNI (past them oneDNN's GEMM is faster), any on AVX2."""
    return _max_rows(selected_isa())


@functools.cache
def _max_rows(isa: int) -> int:
    return int(torch.ops.optkit_int8_gemv.max_rows(isa))


@functools.cache
def max_columns() -> int:
    """The widest K it takes: past it the int32 sum of shifted products could overflow."""
    return int(torch.ops.optkit_int8_gemv.max_columns())


def takes(qx: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """Whether the kernel computes qx [M, K] @ weight_t [K, N]: on the CPU, weight_t column-major (the
    storage of a row-major [N, K], as W8A8Linear.prepare leaves it), 1 to max_rows() rows."""
    return (
        qx.device.type == "cpu"
        and weight_t.device.type == "cpu"
        and weight_t.t().is_contiguous()
        and not unavailable_reason()
        and 1 <= qx.shape[0] <= max_rows()
        and weight_t.shape[0] <= max_columns()
    )


def weight_sums(weight_t: torch.Tensor) -> torch.Tensor:
    """int32 [N]: each output's sum of weights (the shift's correction), computed once per layer."""
    return weight_t.sum(dim=0, dtype=torch.int32).contiguous()


def int8_gemv(qx: torch.Tensor, weight_t: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """qx int8 [M, K] @ weight_t int8 [K, N] -> int32 [M, N], exactly as torch._int_mm (see `takes`)."""
    return _gemv_op()(qx, weight_t.t(), sums, selected_isa())


def int8_linear_dynamic(
    x: torch.Tensor, weight_t: torch.Tensor, sums: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A dynamic W8A8 linear in one call, bit for bit as w8a8.int8_linear's PyTorch code computes it:
    x float32 [M, K] quantized per row, @ weight_t int8 [K, N], rescaled by the row's and weight_scale
    float32 [N], plus bias float32 [N] -> float32 [M, N] (see `takes`, with x for qx)."""
    return _linear_op()(x, weight_t.t(), sums, weight_scale, bias, selected_isa())


@functools.cache
def _gemv_op():
    return torch.ops.optkit_int8_gemv.gemv.default


@functools.cache
def _linear_op():
    return torch.ops.optkit_int8_gemv.linear_dynamic.default
