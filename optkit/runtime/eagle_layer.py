"""The EAGLE-1 head as the runtime runs it (the contract: optkit/speculative/eagle_head.py):

    x = fc(concat(embed(token_{t+1}), feature_t))   [T, 2H] -> [T, H], no bias
    feature'_{t+1} = layer(x)                         the target family's layer 0, no input_layernorm,
                                                      over the head's own paged KV cache
    logits_{t+2} = target.compute_logits(feature'_{t+1})

T packed rows (no batch dimension), each at its target position t, as the target's own step.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from optkit.errors import OptkitError
from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models.config import ModelConfig
from optkit.models.llama import CausalLM, DecoderLayer, KVCache, rope_cos_sin
from optkit.speculative.eagle_head import EagleHead, EagleHeadConfig


def head_model_config(target: ModelConfig, head: EagleHeadConfig) -> ModelConfig:
    """The target's config for one layer of the head's sizes: full attention, a dense MLP."""
    return dataclasses.replace(
        target,
        num_hidden_layers=1,
        num_attention_heads=head.num_attention_heads,
        num_key_value_heads=head.num_key_value_heads,
        head_dim=head.head_dim,
        intermediate_size=head.intermediate_size,
        rms_norm_eps=head.rms_norm_eps,
        sliding_window=None,
        layer_types=(),
        moe=None,
    )


def head_layer(config: ModelConfig) -> DecoderLayer:
    """Layer 0 of the family, its input_layernorm (where it has one) an identity: fc feeds attention."""
    layer = DecoderLayer(config, 0)
    if hasattr(layer, "input_layernorm"):
        layer.input_layernorm = nn.Identity()
    return layer


def layer_shapes(target: ModelConfig, head: EagleHeadConfig) -> dict[str, tuple[int, ...]]:
    """The names (under layers.0.) and shapes of the head's layer tensors, for eagle_head.load_head."""
    with torch.device("meta"):
        layer = head_layer(head_model_config(target, head))
    return {name: tuple(t.shape) for name, t in layer.state_dict().items()}


def input_embeddings(target: CausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """token_ids [T] -> [T, H]: the embedding as the target's first layer receives it (CausalLM.forward)."""
    return target.config.scale_embeddings(target.model.embed_tokens(token_ids))


def check_head_dim(target: CausalLM, head: EagleHead) -> None:
    """A head attends with the target's RoPE tables, so it must have the target's head_dim."""
    if head.config.head_dim != target.config.head_dim:
        raise OptkitError(
            f"the EAGLE head's head_dim {head.config.head_dim} is not the target's {target.config.head_dim}: "
            "its RoPE must be the target's; re-train the head"
        )


def uses_local_rope(target: CausalLM) -> bool:
    """The head's layer takes layer 0's RoPE: Gemma 3's first layer is a sliding one, with the local base."""
    return bool(target.local_rope) and target.local_rope[0]


def head_rope(target: CausalLM, local: bool, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [T, head_dim] at `positions` from the target's global (or, `local`, local) RoPE."""
    if local:
        return rope_cos_sin(positions, target.local_inv_freq, target.local_attention_scaling, dtype)
    return rope_cos_sin(positions, target.inv_freq, target.attention_scaling, dtype)


class HeadLayer(nn.Module):
    """What the proposer calls on either kind of head: forward, then logits."""

    def forward(
        self,
        target: CausalLM,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        real: bool = True,
    ) -> torch.Tensor:
        """token_ids, positions: long [T]; features: the target's (`real`) or the head's own -> the
        head's output [T, H] (`step` of each kind says which)."""
        embeds = input_embeddings(target, token_ids)  # [T, H]
        return self.step(target, embeds, features, positions, meta, kv_cache, real)

    def load_layer(self, target: CausalLM, head: EagleHead, config: ModelConfig, build, dtype, device) -> nn.Module:
        """The head's layer, `build(config)`, with the head's tensors in `dtype` on `device`; keeps the
        config, fc's weight and the RoPE choice (after checking the head's head_dim against the target's)."""
        check_head_dim(target, head)
        self.config = config
        with torch.device("meta"):
            layer = build(config)
        layer.load_state_dict({name: t.to(dtype) for name, t in head.layer.items()}, strict=True, assign=True)
        self.fc_weight = head.fc_weight.to(device=device, dtype=dtype)  # [H, 2H] (EAGLE-1) or [H, 3H] (EAGLE-3)
        self.local_rope = uses_local_rope(target)
        return layer.to(device).eval().requires_grad_(False)


class EagleLayer(HeadLayer):
    def __init__(self, target: CausalLM, head: EagleHead, dtype: torch.dtype, device: torch.device):
        super().__init__()
        config = head_model_config(target.config, head.config)
        self.layer = self.load_layer(target, head, config, head_layer, dtype, device)  # fc: [embedding | feature]

    def step(self, target: CausalLM, embeds, features, positions, meta, kv_cache, real: bool) -> torch.Tensor:
        """features [T, H] (the target's at each position, or, not `real`, the head's own
        predictions: EAGLE-1 treats both alike) -> the predicted next features [T, H], the LM head's input."""
        x = F.linear(torch.cat((embeds, features.to(embeds.dtype)), dim=-1), self.fc_weight)
        cos, sin = head_rope(target, self.local_rope, positions, x.dtype)
        return self.layer(x, cos, sin, meta, kv_cache)

    def logits(self, target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted features [N, H] -> float32 logits [N, V]: the target's own LM head."""
        return target.compute_logits(hidden)
