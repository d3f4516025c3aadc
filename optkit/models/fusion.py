"""One matmul for the linears that read the same input, concatenated along their outputs at load time:
an attention's q, k and v become `qkv_proj`, an MLP's gate and up `gate_up_proj` (the layout Phi-3
stores, models/phi3.py). A decoder layer then runs 4 matmuls instead of 7: on a small model at
batch 1 each call's own cost (casts, reshapes, dispatch) is a large share of the step.

Each output feature is the same dot product as before; a kernel's blocking may round differently
(fp32 GEMM), the integer kernels give the same values. Linears concatenate when they are of one kind
with one layout: `nn.Linear` (one dtype, bias on all or none) or a quantized layer whose class
defines `concatenate` (PackedIntLinear, W8A8Linear: same bits, groups, act-order, input scales). Others
(a mixed-precision artifact's 8-bit q with 4-bit k, NF4) stay apart, and the layer runs them as before.
"""

import torch
from torch import nn


def concatenate(layers: list[nn.Module]) -> nn.Module | None:
    """A module whose output is `layers`' outputs side by side, or None when they cannot be joined."""
    kind = type(layers[0])
    if any(type(m) is not kind for m in layers):
        return None
    if kind is nn.Linear:
        return _concatenate_linear(layers)
    join = getattr(kind, "concatenate", None)
    return join(layers) if join is not None else None


def _concatenate_linear(layers: list[nn.Linear]) -> nn.Linear | None:
    first = layers[0]
    if any(m.weight.dtype != first.weight.dtype or (m.bias is None) != (first.bias is None) for m in layers):
        return None
    weight = torch.cat([m.weight for m in layers])  # [sum of out, in]
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, weight.shape[0], bias=first.bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in layers]), requires_grad=False)
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Replace each attention's q/k/v and each MLP's gate/up by one concatenated linear (in place,
    through their `fuse` methods); returns how many groups were fused."""
    fused = 0
    for module in model.modules():
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None:
            fused += fuse(concatenate)
    return fused
