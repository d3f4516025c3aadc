"""Which layers get quantized: every `nn.Linear` inside the decoder layers, minus `--ignore`."""

import fnmatch
from dataclasses import dataclass

import torch

from optkit.errors import OptkitError


@dataclass(frozen=True)
class LinearTarget:
    name: str  # module path, e.g. "model.layers.0.self_attn.q_proj"
    in_features: int
    out_features: int


def decoder_linears(config) -> list[LinearTarget]:
    """The decoder layers' linear modules, found on a weightless (meta) copy of the model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [
        LinearTarget(name, module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}."
    ]


def select_targets(linears: list[LinearTarget], ignore: list[str]) -> tuple[list[LinearTarget], list[str]]:
    """Split into (targets, ignored names). Each ignore pattern is a glob on module paths."""
    for pattern in ignore:
        if not any(fnmatch.fnmatchcase(t.name, pattern) for t in linears):
            example = linears[0].name if linears else "model.layers.0.mlp.down_proj"
            raise OptkitError(f"--ignore {pattern!r} matches no layer: patterns are globs over names like {example!r}")
    ignored = [t.name for t in linears if any(fnmatch.fnmatchcase(t.name, p) for p in ignore)]
    return [t for t in linears if t.name not in ignored], ignored
