"""bf16 linear layers on the CPU with the weight packed once, at load, into oneDNN's blocked layout.

`F.linear` in bf16 hands oneDNN the row-major weight at every call (its matmul reads it as a
transposed `ba` matrix). On AVX512-BF16 without AMX that makes a bf16 GEMV no faster than fp32's,
although it reads half the bytes. Reordered once (`torch.ops.mkldnn._reorder_linear_weight`: blocks
of 64 outputs x 32 inputs, each pair of inputs adjacent for the bf16 dot-product instruction) and run
as an inner product (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU freezing emits),
the same brgemm kernel streams the weight at its bandwidth (docs/results.md, "CPU decode"). Each
output is the same fp32-accumulated dot product of bf16 inputs, rounded once to bf16.

Without AMX a bf16 GEMM over many rows (a prefill) is slower than fp32's (docs/results.md): compute,
not bytes, bounds it there. Over `UPCAST_ROWS` rows `PackedBf16Linear` unpacks its weight to fp32
(one oneDNN reorder, a few % of such a GEMM) and runs fp32's GEMM on the bf16 inputs made fp32: the
same exact products, summed in fp32 as the bf16 kernel sums them, rounded once to bf16. Only the
packed weight is kept: no second copy.

`pack_linears` is the wrapper: it swaps each bf16 `nn.Linear` of a CPU model for a
`PackedBf16Linear` where this PyTorch has oneDNN's bf16 path; where it has none (a CPU without
AVX-512) for optkit's AVX2 kernel (kernels/cpu_bf16_gemv.py, the weight as it is); elsewhere the
model keeps `F.linear` (the path the tests compare with).
"""

import torch
import torch.nn.functional as F
from torch import nn

from optkit.kernels import cpu_bf16_gemv
from optkit.kernels.module_swap import swap_modules

NAME = "oneDNN bf16 inner product (weight packed at load)"
UPCAST_NAME = "fp32 GEMM on the weight unpacked to fp32 (many rows)"
PACK_ROWS = 1  # the row count oneDNN picks its blocked layout for (decode)
UPCAST_ROWS = 128  # over this many rows, fp32's GEMM on the unpacked weight (measured crossover)


def available() -> bool:
    """oneDNN with a bf16 path on this CPU (AVX512-BF16 or AMX; not ARM's ACL build)."""
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight bf16 [out, in] -> an opaque oneDNN tensor in the blocked layout (torch._mkldnn)."""
    assert weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu", weight.shape
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [..., in] -> bf16 [..., out]: x @ Wᵀ + b through the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def upcast_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same in fp32 arithmetic: bf16 values are exact in fp32, so only the order of the fp32 sums
    differs from the bf16 kernel's."""
    weight = packed.to_dense(torch.float32)  # [out, in]
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(torch.bfloat16)


class PackedBf16Linear(nn.Module):
    """An `nn.Linear` in bf16 whose weight lives packed. The packed tensor is opaque (no storage,
    no `.to()`, no state dict): it is an attribute, not a buffer; `weight` unpacks a plain copy
    for code that reads it (fusion and head policies run before packing)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedBf16Linear":
        return cls(linear.weight.detach(), linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()  # bf16 [out, in], bit for bit the weight that was packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > UPCAST_ROWS * self.in_features:
            return upcast_linear(x, self.packed, self.bias)
        return packed_linear(x.to(torch.bfloat16), self.packed, self.bias)

    def kernel_for(self, device: torch.device | str, rows: int = 1) -> str:
        return UPCAST_NAME if rows > UPCAST_ROWS else NAME

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packable(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.bfloat16
        and module.weight.device.type == "cpu"
        and module.weight.dim() == 2
    )


def fast_linear_class() -> type[nn.Module] | None:
    """The bf16 linear that runs fastest here: oneDNN's packed one, else optkit's AVX2 kernel, else
    none (`F.linear`)."""
    if available():
        return PackedBf16Linear
    if not cpu_bf16_gemv.unavailable_reason():
        return cpu_bf16_gemv.GemvBf16Linear
    return None


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 CPU `nn.Linear` of `model` for `fast_linear_class()` (in place); how many.
    Nothing where there is none."""
    linear_class = fast_linear_class()
    if linear_class is None:
        return 0
    return swap_modules(model, packable, linear_class.from_linear)


def head_linear(embedding: torch.Tensor) -> nn.Module:
    """A tied head over the bf16 `embedding` [vocab, hidden] through `fast_linear_class()`: a packed
    copy for oneDNN (vocab x hidden bf16 more memory), the embedding itself for the AVX2 kernel."""
    linear_class = fast_linear_class()
    assert linear_class is not None, "callers check fast_linear_class() first"
    return linear_class(embedding)
