"""How the output head (the vocabulary projection) runs: full precision, bf16 or int8.

On a small model the head is a large share of a decode step's bytes (shape (b) of
bench/cpu_decode.py: 49,152 x 576, a fifth of the fp32 weights), and a quantized artifact keeps it
in full precision. `apply_head_policy` swaps in a bf16 copy, or an int8 one (per-row symmetric
weights, per-token int8 activations through `W8A8Linear`, the W8A8 kernel); the logits stay fp32.
"""

import torch
import torch.nn.functional as F

from optkit.errors import OptkitError
from optkit.kernels.w8a8 import INT8_MAX, W8A8Linear

HEAD_POLICIES = ("full", "bf16", "int8")


class Bf16Head(torch.nn.Module):
    """logits = bf16(x) · bf16(W)ᵀ, returned in x's dtype."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())  # [V, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


def int8_head(weight: torch.Tensor) -> W8A8Linear:
    """weight [V, hidden] -> int8 per row, scale = max |w| / 127."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)  # [V]
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    layer = W8A8Linear(q, scale)
    layer.prepare()
    return layer


def apply_head_policy(model: torch.nn.Module, policy: str) -> None:
    """Replace `model.lm_head` (or, with tied embeddings, the embedding used as the head) by `policy`'s."""
    if policy not in HEAD_POLICIES:
        raise OptkitError(f"unknown head policy {policy!r}: choose one of {', '.join(HEAD_POLICIES)}")
    if policy == "full":
        return
    head = model.lm_head if model.lm_head is not None else model.get_input_embeddings()
    weight = head.weight
    model.lm_head = Bf16Head(weight) if policy == "bf16" else int8_head(weight)
