"""EAGLE-3's draft head as a trainable torch module (Li et al. 2025; the layer of vLLM's
llama_eagle3.py): one Llama decoder layer whatever the target's family, the target's RoPE.

    residual = fc(g_t)  (a row of real features g_t [3H])  or  h_{t-1}  (the head's own, drafted rows)
    x = concat(input_layernorm(embed(token_{t+1})), hidden_norm(residual))          [.., 2H]
    residual += attn(x);  h_t = residual + mlp(post_attention_layernorm(residual))
    logits_{t+2} = lm_head(norm(h_t))                                                [.., draft vocab]

Its state dict is the on-disk layout of optkit/speculative/eagle_head.py (kind "eagle3"): fc.weight,
layers.0.*, norm.weight, lm_head.weight and d2t. `forward` is plain causal attention over rows (what
the runtime computes, used to simulate chains); `training_time_test` unrolls n drafting steps at once
with the paper's attention pattern (distill3.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from optkit.models.config import SLIDING, ModelConfig


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] by its positions' cos and signed sin [T, 1, R] (models/llama.py's rope_cos_sin),
    the rotate-half pairing over the first R dimensions (models/llama.py's apply_rope, in autograd)."""
    rotary = cos.shape[-1]
    head, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((head * cos + head.roll(rotary // 2, dims=-1) * sin, rest), dim=-1)


class Eagle3Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q [B, Hq, T, D], k and v [B, Hq, T, D] (the kv heads repeated for GQA)."""
        b, t, _ = x.shape
        q = rotate(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, Hq, T, D] -> [B, T, H]."""
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.hidden_norm = nn.RMSNorm(hidden, eps), nn.RMSNorm(hidden, eps)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.self_attn = Eagle3Attention(hidden, heads, kv_heads, config.head_dim)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps)
        self.mlp = Eagle3MLP(hidden, config.intermediate_size)


class Eagle3HeadModel(nn.Module):
    def __init__(self, config: ModelConfig, draft_ids: torch.Tensor, feature_layers: tuple[int, ...]):
        """`config`: the target's (runtime ModelConfig); `draft_ids`: the draft vocabulary's target
        ids [N], ascending."""
        super().__init__()
        hidden = config.hidden_size
        self.feature_layers = tuple(feature_layers)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Block(config)])
        self.norm = nn.RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, len(draft_ids), bias=False)
        # vLLM's draft_id_to_target_id: target id = d + d2t[d]
        self.register_buffer("d2t", draft_ids.long() - torch.arange(len(draft_ids)))
        # the target's RoPE as its layer 0 takes it (Gemma 3: the local base), as runtime/eagle3_layer.py
        local = bool(config.layer_types) and config.layer_types[0] == SLIDING and config.local_rope_parameters
        inv_freq, self.attention_scaling = config.local_rope_frequencies() if local else config.rope_frequencies()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = config.head_dim**-0.5

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        from optkit.models.llama import rope_cos_sin

        return rope_cos_sin(positions, self.inv_freq, self.attention_scaling, dtype)

    def _inputs(self, embeds: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        block = self.layers[0]
        return torch.cat((block.input_layernorm(embeds), block.hidden_norm(residual)), dim=-1)

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        block = self.layers[0]
        residual = residual + block.self_attn.out(attended)
        return residual + block.mlp(block.post_attention_layernorm(residual))

    def forward(self, embeds: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds, residual [B, T, H] (fc(g) for real rows, the head's own h for drafted ones);
        positions [T]. Causal over T -> h [B, T, H], the pre-norm outputs."""
        cos, sin = self.rope(positions, residual.dtype)
        q, k, v = self.layers[0].self_attn.qkv(self._inputs(embeds, residual), cos, sin)
        length = q.shape[2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        return self._finish(residual, F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=self.scale))

    def training_time_test(self, embeds: list[torch.Tensor], fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test: `steps` drafting steps unrolled over every row at once.

        Row r of step 0 sits at position r with the real residual fc(g_r) [B, T, H]; row r of step i
        sits at position r+i with the head's own h of row r at step i-1 and the token embeds[i][:, r]
        (x_{r+i+1}). As when it is served, row r of step i attends to the real rows 0..r of step 0
        (causal) and to row r of steps 1..i (its own chain: the paper's diagonal), nothing else.
        Returns h of every step, [B, T, H] each."""
        length = fused.shape[1]
        positions = torch.arange(length, device=fused.device)
        causal = torch.ones(length, length, dtype=torch.bool, device=fused.device).tril()
        keys, values, outputs, residual = [], [], [], fused
        for i in range(steps):
            cos, sin = self.rope(positions + i, residual.dtype)
            q, k, v = self.layers[0].self_attn.qkv(self._inputs(embeds[i], residual), cos, sin)  # [B, Hq, T, D]
            if i == 0:
                keys0, values0 = k, v
            else:
                keys.append(k)
                values.append(v)
            scores = (q @ keys0.transpose(-1, -2) * self.scale).masked_fill(~causal, float("-inf"))  # [B, Hq, T, T]
            diagonal = [(q * key).sum(-1, keepdim=True) * self.scale for key in keys]  # [B, Hq, T, 1] each
            probs = torch.cat([scores, *diagonal], dim=-1).softmax(-1)
            attended = probs[..., :length] @ values0
            for j, value in enumerate(values):
                attended = attended + probs[..., length + j : length + j + 1] * value
            residual = self._finish(residual, attended)
            outputs.append(residual)
        return outputs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> logits [..., draft vocab]."""
        return self.lm_head(self.norm(hidden))


def new_eagle3_head(target: nn.Module, seed: int, draft_ids: torch.Tensor, feature_layers) -> Eagle3HeadModel:
    """An untrained EAGLE-3 head for `target` (a transformers model, float32), initialised from `seed` alone."""
    config = ModelConfig.from_hf(target.config.to_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3HeadModel(config, draft_ids, feature_layers).float()
        for module in head.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=getattr(target.config, "initializer_range", 0.02))
    return head
