"""Phi-3 / 3.5 / 4 mini in the runtime: Llama's decoder (models/llama.py) with q, k and v from one
fused linear and gate and up from another, kept fused as the checkpoint stores them (one GEMM instead
of three, or two; a quantized artifact quantizes them fused too) and split after the matmul.
LongRoPE and the partial rotary factor are ModelConfig's (models/config.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from optkit.models import llama
from optkit.models.config import ModelConfig


class FusedQKVAttention(llama.Attention):
    """Attention whose q, k and v come from `qkv_proj`: rows [q (Hq·D) | k (Hkv·D) | v (Hkv·D)]."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        del self.q_proj, self.k_proj, self.v_proj
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one linear: `gate_up_proj` rows [gate (I) | up (I)]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(up * F.silu(gate))


class CausalLM(llama.CausalLM):
    """llama.CausalLM with each layer's attention and MLP replaced by their fused forms."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn = FusedQKVAttention(config)
            layer.mlp = FusedMLP(config)
