"""fp32 linear layers on the CPU through oneDNN with the weight packed once, at load, where MKL's fp32
GEMM is slow at the few rows of a decode step.

PyTorch runs an fp32 `F.linear` on the CPU through MKL. On CPUs not made by Intel MKL takes a generic
code path: on an AMD Zen 3 its GEMM ran at 0.3-0.9x oneDNN's inner product over the same weight
reordered into oneDNN's blocked layout at 1 to 32 rows (`bench/cpu_fp32_linear.py`), the rows of a
decode step, while from ~256 rows (a prefill) MKL is 5-25% faster. `PackedFp32Linear` keeps only the
packed weight (no second copy), runs up to PACKED_ROWS rows through it, and more rows through
`F.linear` on the weight unpacked for that call (one oneDNN reorder, a few % of such a GEMM). Each
output is an fp32 dot product summed in another order than MKL's: within float32 rounding of
transformers' logits, not bit for bit. Unlike MKL's, a row's output does not depend on how many rows
the call has.

`pack_linears` swaps each fp32 CPU `nn.Linear` of a model for it where `chosen()`: on CPUs not made by
Intel; OPTKIT_CPU_FP32_GEMM=onednn or =mkl sets the choice (A/B runs, or a CPU where the other wins).
A tied head stays on `F.linear` over the embedding (a packed copy would cost vocab x hidden x 4 bytes).
"""

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from optkit.errors import OptkitError

NAME = "oneDNN fp32 inner product (weight packed at load)"
UNPACKED_NAME = "MKL fp32 GEMM on the weight unpacked for the call (many rows)"
PACKED_ROWS = 32  # up to this many rows through the packed weight (measured crossover: 64)
CHOICES = ("onednn", "mkl")


def cpu_vendor() -> str:
    """The CPU's vendor string (/proc/cpuinfo's vendor_id, e.g. GenuineIntel, AuthenticAMD); "" where
    it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


@functools.cache
def chosen() -> bool:
    """Whether this process's fp32 CPU linears run through oneDNN's packed weights (read once)."""
    setting = os.environ.get("OPTKIT_CPU_FP32_GEMM", "")
    if setting and setting not in CHOICES:
        raise OptkitError(f"OPTKIT_CPU_FP32_GEMM={setting!r}: set it to {' or '.join(CHOICES)}, or unset it")
    if setting == "mkl" or not torch.backends.mkldnn.is_available():
        return False
    return setting == "onednn" or cpu_vendor() not in ("GenuineIntel", "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight fp32 [out, in] -> an opaque oneDNN tensor in the blocked layout (torch._mkldnn)."""
    assert weight.dtype == torch.float32 and weight.dim() == 2 and weight.device.type == "cpu", weight.shape
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


class PackedFp32Linear(nn.Module):
    """An `nn.Linear` in fp32 whose weight lives packed. The packed tensor is opaque (no storage,
    no `.to()`, no state dict): it is an attribute, not a buffer; `weight` unpacks a plain copy for
    code that reads it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedFp32Linear":
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()  # fp32 [out, in], bit for bit the weight that was packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.numel() > PACKED_ROWS * self.in_features:
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def kernel_for(self, device: torch.device | str, rows: int = 1) -> str:
        return UNPACKED_NAME if rows > PACKED_ROWS else NAME

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and weight is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
    )


def pack_linears(model: nn.Module) -> int:
    """Swap every fp32 CPU `nn.Linear` of `model` for a `PackedFp32Linear` (in place) where
    `chosen()`; how many."""
    if not chosen():
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if packable(child)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedFp32Linear.from_linear(child))
    return len(swaps)
