"""Per-layer precision in one checkpoint, written the way each format's own readers understand it.

- compressed-tensors: one `config_groups` entry per scheme (bits and group size: quant/ladder.py's
  rungs). The artifact's scheme keeps the class target `Linear`; each other scheme targets its
  layers by exact name, which compressed-tensors
  (and vLLM) match before class names. Layers kept in full precision join `ignore`.
- GPTQ: gptqmodel's `dynamic` overrides, `{"+:REGEX": {"bits": 8, "group_size": 32}, "-:REGEX": {}}` ("-:" leaves the
  module unquantized), matched with `re.match` on module names by gptqmodel and vLLM. vLLM matches
  fused modules (`qkv_proj`, `gate_up_proj`) by their fused name, so each pattern names both.
vLLM requires the shards of a fused module to share one scheme, so precision changes by `fused_units`.
A format without such a block (AWQ) is refused in one line.
"""

import re
from collections import defaultdict

import torch

from optkit.errors import OptkitError
from optkit.quant.formats.common import dequantize_layers
from optkit.quant.ladder import FULL_PRECISION, Rung, nominal_bits
from optkit.weights.schemes import WeightScheme

# shards that vLLM loads as one fused module -> the fused module's name
FUSED = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}
MIXED_FORMATS = ("compressed-tensors", "gptq")


def fused_units(names: list[str]) -> list[list[str]]:
    """Linears grouped as vLLM fuses them (q/k/v, gate/up of one layer); others alone. Order kept."""
    units: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        shards = next((s for s in FUSED if leaf in s), None)
        key = f"{parent}.{FUSED[shards]}" if shards else name
        units.setdefault(key, []).append(name)
    return list(units.values())


def check_mixed(format_name: str) -> None:
    if format_name not in MIXED_FORMATS:
        raise OptkitError(
            f"--format {format_name} has no per-layer precision in its config: "
            f"repair with --format {' or '.join(MIXED_FORMATS)}"
        )


def mixed_quantization_config(format_name: str, config: dict, default: WeightScheme, rungs: dict[str, Rung]) -> dict:
    """`config` (the artifact's uniform `quantization_config`, scheme `default`) with each layer of
    `rungs` on its rung: another bit width, another group size, or full precision."""
    check_mixed(format_name)
    config = {**config}
    by_rung: dict[Rung, list[str]] = defaultdict(list)
    for name, rung in sorted(rungs.items()):
        by_rung[rung.resolve(default)].append(name)
    ordered = sorted(by_rung.items(), key=lambda item: nominal_bits(item[0], default))
    if format_name == "compressed-tensors":
        template = config["config_groups"]["group_0"]
        groups = {}  # raised groups first: compressed-tensors tries targets in this order
        for rung, names in ordered:
            if not rung.full:
                weights = {
                    **template["weights"],
                    "num_bits": rung.bits,
                    "strategy": "channel" if rung.group_size == -1 else "group",
                    "group_size": None if rung.group_size == -1 else rung.group_size,
                    "actorder": None,  # re-quantized by round-to-nearest, in column order
                }
                groups[f"group_{rung.label}"] = {**template, "targets": names, "weights": weights}
        config["config_groups"] = {**groups, "group_0": template}
        config["ignore"] = list(config.get("ignore", [])) + by_rung.get(Rung(FULL_PRECISION), [])
        return config
    dynamic = {}
    for rung, names in ordered:
        for pattern in _patterns(names):
            if rung.full:
                dynamic[f"-:{pattern}"] = {}
            else:  # gptqmodel and vLLM read bits and group_size per module; unchanged keys are left out
                override = {"bits": rung.bits}
                if rung.group_size != default.group_size:
                    override["group_size"] = rung.group_size
                dynamic[f"+:{pattern}"] = override
    config["dynamic"] = dynamic
    return config


def _patterns(names: list[str]) -> list[str]:
    """One anchored regex per fused unit of `names`, matching its shards and its fused name."""
    patterns = []
    for unit in fused_units(names):
        parent = unit[0].rpartition(".")[0]
        leaves = [n.rpartition(".")[2] for n in unit]
        shards = next((s for s in FUSED if set(leaves) == set(s)), None)
        alternatives = leaves + ([FUSED[shards]] if shards else [])
        patterns.append(rf"{re.escape(parent)}\.({'|'.join(map(re.escape, alternatives))})$")
    return patterns


def is_mixed(quant_config: dict) -> bool:
    return len(quant_config.get("config_groups") or {}) > 1 or bool(quant_config.get("dynamic"))


def layer_schemes(fmt, quant_config: dict, prefixes: list[str]) -> dict[str, WeightScheme]:
    """The scheme of each quantized linear of a checkpoint (one for all unless it is mixed)."""
    default = fmt.scheme_from_config(_uniform(quant_config))
    if not is_mixed(quant_config):
        return dict.fromkeys(prefixes, default)
    schemes = {}
    for prefix in prefixes:
        scheme = default
        if quant_config.get("dynamic"):
            for key, override in quant_config["dynamic"].items():
                sign, pattern = (key[0], key[2:]) if key.startswith(("+:", "-:")) else ("+", key)
                if sign == "+" and re.match(pattern, prefix):
                    fields = {"bits": "bits", "group_size": "group_size", "sym": "symmetric"}
                    scheme = scheme.model_copy(update={fields[k]: v for k, v in override.items() if k in fields})
                    break
        else:
            for group in quant_config["config_groups"].values():
                if any(t == prefix or (t.startswith("re:") and re.match(t[3:], prefix)) for t in group["targets"]):
                    scheme = _scheme_of(group["weights"], default)
                    break
        schemes[prefix] = scheme
    return schemes


def _uniform(quant_config: dict) -> dict:
    """The config without its overrides: the artifact's own scheme (group_0, or the GPTQ top level)."""
    if quant_config.get("config_groups") and len(quant_config["config_groups"]) > 1:
        return {**quant_config, "config_groups": {"group_0": quant_config["config_groups"]["group_0"]}}
    return {k: v for k, v in quant_config.items() if k != "dynamic"}


def _scheme_of(weights: dict, default: WeightScheme) -> WeightScheme:
    group_size = -1 if weights.get("strategy") == "channel" else weights.get("group_size", default.group_size)
    return default.model_copy(
        update={"bits": weights["num_bits"], "group_size": group_size, "symmetric": weights["symmetric"]}
    )


def dequantized_state_dict(fmt, tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype) -> dict:
    """The format's plain state dict, each quantized linear dequantized with its own scheme."""
    if not is_mixed(quant_config):
        return fmt.dequantized_state_dict(tensors, quant_config, dtype)
    prefixes = [k.removesuffix(f".{fmt.MARKER}") for k in tensors if k.endswith(f".{fmt.MARKER}")]
    schemes = layer_schemes(fmt, quant_config, prefixes)
    return dequantize_layers(
        tensors, fmt.MARKER, fmt.SUFFIXES, lambda prefix: fmt.decompress(prefix, tensors, schemes[prefix]), dtype
    )
