"""The EAGLE-3 head as the runtime runs it (the contract: optkit/speculative/eagle_head.py; vLLM's
llama_eagle3.py): one Llama decoder layer whatever the target's family, over its own paged KV cache.

    residual = fc(g_t)                 g_t [3H]: the target's residual streams at three layers (a real row)
             = h_{t-1}                 or the head's own pre-norm output one row back (a drafted row)
    x = concat(input_layernorm(embed(token_{t+1})), hidden_norm(residual))        [T, 2H]
    residual += self_attn(x);  residual += mlp(post_attention_layernorm(residual))
    h_t = residual;  logits_{t+2} = lm_head(norm(h_t)) on the draft vocabulary, scattered into the
    target's (-inf at tokens outside it: the head never proposes them)

T packed rows (no batch dimension), each at its target position t, as the target's own step. The
attention takes the target's RoPE (its layer 0's: Gemma 3's local base), full attention.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from optkit.models.config import ModelConfig
from optkit.models.llama import MLP, Attention, CausalLM, make_norm
from optkit.runtime.eagle_layer import HeadLayer, head_model_config, head_rope
from optkit.speculative.eagle_head import EagleHead, EagleHeadConfig


def eagle3_model_config(target: ModelConfig, head: EagleHeadConfig) -> ModelConfig:
    """A one-layer Llama config of the head's sizes (the target's RoPE and eps): no biases, no q/k
    norms, plain RMSNorm, SwiGLU, full attention at 1/√head_dim."""
    return dataclasses.replace(
        head_model_config(target, head),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=None,
        post_norms=False,
        norm_weight_in_float32=False,
        residual_multiplier=1.0,
        attention_multiplier=None,
        norm_weight_offset=0.0,
        sandwich_norms=False,
        hidden_act="silu",
        attn_logit_softcapping=None,
    )


class Eagle3Block(nn.Module):
    """The layer's modules under vLLM's names; q/k/v read 2H inputs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm, self.hidden_norm = make_norm(config), make_norm(config)
        self.self_attn = Attention(config, 0)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * hidden, attn.num_heads * attn.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden, attn.num_kv_heads * attn.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * hidden, attn.num_kv_heads * attn.head_dim, bias=False)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = MLP(config)


def eagle3_layer_shapes(target: ModelConfig, head: EagleHeadConfig) -> dict[str, tuple[int, ...]]:
    """The names (under layers.0.) and shapes of the head's layer tensors, for eagle_head.load_head."""
    with torch.device("meta"):
        block = Eagle3Block(eagle3_model_config(target, head))
    return {name: tuple(t.shape) for name, t in block.state_dict().items()}


class Eagle3Layer(HeadLayer):
    def __init__(self, target: CausalLM, head: EagleHead, dtype: torch.dtype, device: torch.device):
        super().__init__()
        config = eagle3_model_config(target.config, head.config)
        self.block = self.load_layer(target, head, config, Eagle3Block, dtype, device)
        with torch.device("meta"):
            self.norm = make_norm(self.config)
        self.norm.load_state_dict({"weight": head.output["norm.weight"].to(dtype)}, assign=True)
        self.norm.to(device)
        self.lm_head_weight = head.output["lm_head.weight"].to(device=device, dtype=dtype)  # [N, H]
        d2t = head.output["d2t"]
        self.draft_to_target = (torch.arange(len(d2t)) + d2t).to(device)  # [N]: the target's ids
        self.vocab_size = target.config.vocab_size

    def step(self, target: CausalLM, embeds, features, positions, meta, kv_cache, real: bool) -> torch.Tensor:
        """features: the target's [T, 3H] (`real`) or the head's own [T, H] -> h [T, H], the
        pre-norm output a drafted row feeds back (`logits` reads it)."""
        residual = F.linear(features.to(embeds.dtype), self.fc_weight) if real else features.to(embeds.dtype)
        block = self.block
        x = torch.cat((block.input_layernorm(embeds), block.hidden_norm(residual)), dim=-1)  # [T, 2H]
        cos, sin = head_rope(target, self.local_rope, positions, x.dtype)
        residual = residual + block.self_attn(x, cos, sin, meta, kv_cache)
        return residual + block.mlp(block.post_attention_layernorm(residual))

    def logits(self, target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """h [N, H] -> float32 logits [N, V] over the target's vocabulary, -inf outside the draft's."""
        draft = F.linear(self.norm(hidden), self.lm_head_weight).float()  # [N, draft vocab]
        logits = draft.new_full((len(hidden), self.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft
        return logits
