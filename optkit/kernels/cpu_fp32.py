"""fp32 linear layers on the CPU through oneDNN with the weight packed once, at load, where MKL's fp32
GEMM is slow at the few rows of a decode step.

PyTorch runs an fp32 `F.linear` on the CPU through MKL. On CPUs not made by Intel MKL takes a generic
code path: on an AMD Zen 3 its GEMM at 1 to 64 rows (a decode step's) ran at 0.3-0.9x oneDNN's inner
product over the same weight reordered into oneDNN's blocked layout, and at a prefill chunk's 256-640
rows at 0.9-1.15x (`bench/cpu_fp32_linear.py`). `PackedFp32Linear` keeps only the packed weight (no
second copy: unpacking it for MKL at every call cost more than the GEMM at 64 rows) and runs every
row count through it. Each output is an fp32 dot product summed in another order than MKL's: within
float32 rounding of transformers' logits, not bit for bit; unlike MKL's, a row's output does not
depend on how many rows share the call.

`pack_linears` swaps each fp32 CPU `nn.Linear` of a model for it where `chosen()`: on CPUs not made by
Intel; OPTKIT_CPU_FP32_GEMM=onednn or =mkl sets the choice (A/B runs, or a CPU where the other wins).
The loader does so for a model that serves (`prepare`), not for the gate's evaluation of long
windows, whose 512-2048 rows a call MKL runs as fast or faster (and there, bit for bit as
transformers). A tied head stays on `F.linear` over the embedding (a packed copy would cost vocab x
hidden x 4 bytes).
"""

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from optkit.errors import OptkitError
from optkit.kernels.module_swap import swap_modules

NAME = "oneDNN fp32 inner product (weight packed at load)"
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
        if x.dtype != torch.float32:  # the module's weight is fp32: as nn.Linear, the dtypes must agree
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def kernel_for(self, device: torch.device | str, rows: int = 1) -> str:
        return NAME

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
    return swap_modules(model, packable, PackedFp32Linear.from_linear)
