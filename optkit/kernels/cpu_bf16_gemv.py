"""bf16 linear layers on AVX2 CPUs that oneDNN has no bf16 path for (no AVX-512: AMD Zen 3, Intel
before Ice Lake servers), in optkit's C++ (cpu_bf16_gemv.cpp).

Why: there ATen's bf16 GEMM is no faster than fp32's at one row although it reads half the bytes, and
4-14x slower than fp32's at 16 rows (docs/results.md, "bf16 on AVX2"). This kernel widens the bf16
weight to fp32 in registers (one unpack per 8 values) and sums exact products with FMA: each output
is the fp32-accumulated dot product rounded once to bf16, as oneDNN's bf16 inner product computes it.
The weight stays the model's own tensor (no packed copy; a tied head shares the embedding's).

It takes every row count: past ~64 rows (a prefill) it runs at 0.7-1.3x fp32's GEMM, where fp32's
GEMM on the weight widened for the call is no faster and allocates that fp32 copy at every call.
Built at first use into $OPTKIT_CACHE/kernels (kernels/cpp_build.py); a failed build or a CPU without
AVX2 keeps `F.linear`.
"""

import functools
from pathlib import Path

import torch
from torch import nn

from optkit.kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_bf16_gemv.cpp")
NAME = "optkit C++ bf16 GEMV (AVX2, FMA)"


@functools.cache
def unavailable_reason() -> str:
    """An empty string when the kernel runs here; otherwise why not (checked once per process)."""
    reason = cpp_build.load(SOURCE, "optkit_bf16_gemv")
    if not reason and not torch.ops.optkit_bf16_gemv.has_avx2_fma():
        return "this CPU has no AVX2 with FMA"
    return reason


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [..., K] @ weight bf16 [N, K]ᵀ (+ bias) -> bf16 [..., N] (callers check
    unavailable_reason() first)."""
    y = _linear_op()(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@functools.cache
def _linear_op():
    return torch.ops.optkit_bf16_gemv.linear.default


class GemvBf16Linear(nn.Module):
    """An `nn.Linear` in bf16 on the CPU through the kernel; `weight` is the tensor it was given (a tied
    head's is the embedding's, shared)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "GemvBf16Linear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_linear(x.to(torch.bfloat16), self.weight, self.bias)

    def kernel_for(self, device: torch.device | str, rows: int = 1) -> str:
        return NAME

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
