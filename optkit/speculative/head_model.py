"""EAGLE-1's draft head as a trainable torch module, built from the target family's own
transformers decoder layer (Li et al. 2024, the reference code's cnets.py).

    x_t = fc(concat(embed(token_{t+1}), feature_t))      fc: [2H -> H], no bias
    feature_{t+1}' = decoder_layer(x_t)                 input_layernorm skipped, as cnets.py's layer 0
    logits_{t+2}' = target.lm_head(feature_{t+1}')      the target's frozen LM head

`feature_t` is the target's last hidden state after its final norm (the LM head's input) at
position t; the head's position t is the target's. Its state dict is the on-disk layout of
optkit/speculative/eagle_head.py: `fc.weight` and the layer under `layers.0.` with the family's
Hugging Face names.
"""

import copy

import torch
from torch import nn


def decoder_classes(target: nn.Module) -> tuple[type[nn.Module], type[nn.Module]]:
    """The target's transformers decoder layer class and rotary embedding class."""
    decoder = target.get_decoder()
    return type(decoder.layers[0]), type(decoder.rotary_emb)


class EagleHeadModel(nn.Module):
    def __init__(self, target_config, layer_class: type[nn.Module], rotary_class: type[nn.Module]):
        super().__init__()
        config = copy.deepcopy(target_config)
        # eager attention with an explicit causal mask: every family's layer takes it (sdpa refuses
        # Gemma 2's soft-capping); full attention, as the head is served (runtime/eagle_layer.py)
        config._attn_implementation = "eager"
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        layer = layer_class(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # fc's output goes straight into attention
        self.layers = nn.ModuleList([layer])
        self.rotary = rotary_class(config)  # inv_freq is a non-persistent buffer: not saved
        # Gemma 3 keeps a RoPE per layer type (rope_parameters keyed by it): layer 0's, as served
        layer_types, rope = getattr(config, "layer_types", None), getattr(config, "rope_parameters", None) or {}
        per_type = bool(layer_types) and isinstance(rope, dict) and layer_types[0] in rope
        self.layer_type = layer_types[0] if per_type else None

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """embeds, features: [B, T, H] (embedding of token t+1, target feature at t); position_ids:
        [B, T]. Returns the predicted features [B, T, H] (at t+1), causal over T."""
        hidden = self.fc(torch.cat((embeds, features), dim=-1))
        if self.layer_type is None:
            position_embeddings = self.rotary(hidden, position_ids)
        else:
            position_embeddings = self.rotary(hidden, position_ids, self.layer_type)
        length = hidden.shape[1]
        causal = torch.full((length, length), float("-inf"), dtype=hidden.dtype, device=hidden.device).triu(1)
        out = self.layers[0](
            hidden,
            attention_mask=causal[None, None],
            position_embeddings=position_embeddings,
            position_ids=position_ids,
        )
        return out[0] if isinstance(out, tuple) else out


def first_layer_embedding(target: nn.Module):
    """token ids [...] -> [..., H]: the embedding as the target's first decoder layer receives it,
    as the runtime serves the head (ModelConfig.scale_embeddings on the embedding matrix's rows:
    Gemma's rounded √hidden, Granite's embedding_multiplier)."""
    from optkit.models.config import ModelConfig

    config = ModelConfig.from_hf(target.config.to_dict())
    weight = target.get_input_embeddings().weight
    return lambda token_ids: config.scale_embeddings(nn.functional.embedding(token_ids, weight))


def new_head(target: nn.Module, seed: int) -> EagleHeadModel:
    """An untrained head for `target` (float32), initialised from `seed` alone."""
    layer_class, rotary_class = decoder_classes(target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHeadModel(target.config, layer_class, rotary_class).float()
        for module in head.modules():  # transformers' layers leave init to the model's _init_weights
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=getattr(target.config, "initializer_range", 0.02))
    return head
