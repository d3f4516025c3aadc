"""Which layers get quantized: every `nn.Linear` inside the decoder layers, minus `--ignore`."""

import fnmatch
from dataclasses import dataclass

import torch

from optkit.errors import OptkitError
from optkit.families import family_for
from optkit.quant.moe import unfuse_experts


@dataclass(frozen=True)
class LinearTarget:
    name: str  # module path, e.g. "model.layers.0.self_attn.q_proj"
    in_features: int
    out_features: int


def decoder_linears(config, *, quantize_router: bool = False) -> list[LinearTarget]:
    """The decoder layers' linear modules, found on a weightless (meta) copy of the model, under
    their checkpoint names. Mixture-of-experts models: each expert's linears (transformers fuses
    them into 3D parameters), and not the routers and shared-expert gates (`full_precision_gates`)
    unless `quantize_router` (the routers then are, the shared-expert gates never)."""
    from transformers import AutoModelForCausalLM

    family = family_for(config.model_type)
    if quantize_router and family.moe is None:
        raise OptkitError(
            f"quantize_router (--quantize-router): {config.model_type} is not a mixture of experts and has no router; "
            "drop the option"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if family.moe is not None:
        unfuse_experts(model.get_decoder().layers, family, config.to_dict())
    gates = set(full_precision_gates(config, quantize_router=quantize_router))
    # the decoder's layers only: not a vision tower's (Gemma 3's SigLIP also has `layers`)
    decoder = next(name for name, module in model.named_modules() if module is model.get_decoder())
    return [
        LinearTarget(family.checkpoint_name(name), module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and name.startswith(f"{decoder}.layers.")
        and family.checkpoint_name(name) not in gates
    ]


def full_precision_gates(config, *, quantize_router: bool = False) -> list[str]:
    """The routers and shared-expert gates of a mixture-of-experts model (checkpoint names): they
    choose experts rather than compute, and stay in full precision; with `quantize_router`, only
    the shared-expert gates (a [1, hidden] linear) do."""
    family = family_for(config.model_type)
    if family.moe is None:
        return []
    prefix = "model.layers"
    sparse = [i for i in range(config.num_hidden_layers) if family.moe.is_sparse(config.to_dict(), i)]
    gates = [g for g in family.moe.full_precision if not (quantize_router and g == family.moe.router_name)]
    return [family.checkpoint_name(f"{prefix}.{i}.{gate}") for i in sparse for gate in gates]


def outside_decoder_linears(config) -> list[str]:
    """The linears outside the decoder's layers, as transformers names its modules: lm_head, and a
    multimodal model's vision tower and projector (Gemma 3), which stay in full precision."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decoder = next(name for name, module in model.named_modules() if module is model.get_decoder())
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return [n for n in linears if not n.startswith(f"{decoder}.layers.")] or ["lm_head"]


def select_targets(linears: list[LinearTarget], ignore: list[str]) -> tuple[list[LinearTarget], list[str]]:
    """Split into (targets, ignored names). Each ignore pattern is a glob on module paths."""
    for pattern in ignore:
        if not any(fnmatch.fnmatchcase(t.name, pattern) for t in linears):
            example = linears[0].name if linears else "model.layers.0.mlp.down_proj"
            raise OptkitError(f"--ignore {pattern!r} matches no layer: patterns are globs over names like {example!r}")
    ignored = [t.name for t in linears if any(fnmatch.fnmatchcase(t.name, p) for p in ignore)]
    return [t for t in linears if t.name not in ignored], ignored
