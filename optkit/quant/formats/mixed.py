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

import regex
import torch
from pydantic import ValidationError

from optkit.errors import OptkitError, shown
from optkit.quant.formats.common import dequantize_layers
from optkit.quant.ladder import FULL_PRECISION, Rung, nominal_bits
from optkit.untrusted_regex import RegexBudget, compile_untrusted
from optkit.weights.schemes import WeightScheme

# shards that vLLM loads as one fused module -> the fused module's name
FUSED = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}
MIXED_FORMATS = ("compressed-tensors", "gptq")
MATCH_BUDGET_S = 2.0  # every override pattern against every layer name of one checkpoint


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
        scope = rf"{re.escape(parent)}\." if parent else ""  # a top-level module (lm_head) has no parent
        patterns.append(rf"{scope}({'|'.join(map(re.escape, alternatives))})$")
    return patterns


def is_mixed(quant_config: dict) -> bool:
    return len(quant_config.get("config_groups") or {}) > 1 or bool(quant_config.get("dynamic"))


def layer_schemes(fmt, quant_config: dict, prefixes: list[str], source: str = "config.json") -> dict[str, WeightScheme]:
    """The scheme of each quantized linear of a checkpoint (one for all unless it is mixed).

    A checkpoint comes from someone else: each override is validated as the artifact's own scheme
    is, and its patterns (GPTQ `dynamic` keys, compressed-tensors `re:` targets) run under one
    time budget for the whole checkpoint (optkit/untrusted_regex.py). `source`: the file, for
    messages."""
    default = _default_scheme(fmt, quant_config, source)
    if not is_mixed(quant_config):
        return dict.fromkeys(prefixes, default)
    budget = RegexBudget(MATCH_BUDGET_S, source)
    if quant_config.get("dynamic"):
        rules = _dynamic_rules(quant_config["dynamic"], default, source)
    else:
        rules = _group_rules(quant_config["config_groups"], default, source)
    schemes = {}
    for prefix in prefixes:
        scheme = default
        for names, pattern, override in rules:
            if prefix in names or (pattern is not None and budget.match(pattern, prefix)):
                scheme = override
                break
        schemes[prefix] = scheme
    return schemes


_DYNAMIC_FIELDS = {"bits": "bits", "group_size": "group_size", "sym": "symmetric"}
Rule = tuple[frozenset[str], regex.Pattern | None, WeightScheme]  # exact names, a pattern, the scheme


def _dynamic_rules(dynamic: object, default: WeightScheme, source: str) -> list[Rule]:
    """gptqmodel's `dynamic`: {"+:REGEX" or "REGEX": {bits, group_size, sym}, "-:REGEX": {}}, first match wins."""
    where = f"{source}: quantization_config.dynamic"
    if not isinstance(dynamic, dict):
        raise OptkitError(
            f"{where} must map patterns to overrides, not {type(dynamic).__name__}: re-create the artifact"
        )
    rules = []
    for key, override in dynamic.items():
        sign, pattern = (key[0], key[2:]) if key.startswith(("+:", "-:")) else ("+", key)
        compiled = compile_untrusted(pattern, where)
        if not isinstance(override, dict):
            raise OptkitError(f'{where}[{shown(key)}] must be a mapping such as {{"bits": 8}}: re-create the artifact')
        fields = {_DYNAMIC_FIELDS[k]: v for k, v in override.items() if k in _DYNAMIC_FIELDS}
        if sign == "+":  # a "-:" layer is stored unquantized: it has no scheme to look up
            rules.append((frozenset(), compiled, _validated(default, fields, f"{where}[{shown(key)}]")))
    return rules


def _group_rules(groups: object, default: WeightScheme, source: str) -> list[Rule]:
    """compressed-tensors' `config_groups`: each group's targets are exact names or `re:` patterns."""
    where = f"{source}: quantization_config.config_groups"
    if not isinstance(groups, dict):
        raise OptkitError(f"{where} must map group names to groups: re-create the artifact")
    rules = []
    for name, group in groups.items():
        targets = group.get("targets") if isinstance(group, dict) else None
        weights = group.get("weights") if isinstance(group, dict) else None
        if (
            not isinstance(targets, list)
            or not all(isinstance(t, str) for t in targets)
            or not isinstance(weights, dict)
        ):
            raise OptkitError(
                f"{where}.{shown(name)} needs a list of targets and a weights mapping: re-create the artifact"
            )
        scheme = _scheme_of(weights, default, f"{where}.{shown(name)}.weights")
        exact = frozenset(t for t in targets if not t.startswith("re:"))
        rules.append((exact, None, scheme))
        rules += [
            (frozenset(), compile_untrusted(t[3:], f"{where}.{shown(name)}.targets"), scheme)
            for t in targets
            if t.startswith("re:")
        ]
    return rules


def _uniform(quant_config: dict) -> dict:
    """The config without its overrides: the artifact's own scheme (group_0, or the GPTQ top level)."""
    if quant_config.get("config_groups") and len(quant_config["config_groups"]) > 1:
        return {**quant_config, "config_groups": {"group_0": quant_config["config_groups"]["group_0"]}}
    return {k: v for k, v in quant_config.items() if k != "dynamic"}


def _default_scheme(fmt, quant_config: dict, source: str) -> WeightScheme:
    try:
        return fmt.scheme_from_config(_uniform(quant_config))
    except KeyError as e:
        raise OptkitError(f"{source}: quantization_config has no {shown(e.args[0])}: re-create the artifact") from None
    except ValidationError as e:
        raise OptkitError(f"{source}: quantization_config: {_first_error(e)}: re-create the artifact") from None


def _scheme_of(weights: dict, default: WeightScheme, where: str) -> WeightScheme:
    fields = {}
    for key, field in (("num_bits", "bits"), ("symmetric", "symmetric")):
        if key in weights:
            fields[field] = weights[key]
    if weights.get("strategy") == "channel":
        fields["group_size"] = -1
    elif weights.get("group_size") is not None:
        fields["group_size"] = weights["group_size"]
    return _validated(default, fields, where)


def _validated(default: WeightScheme, fields: dict, where: str) -> WeightScheme:
    """`default` with `fields` changed, validated as the top-level scheme is (model_copy would not)."""
    try:
        return WeightScheme.model_validate({**default.model_dump(), **fields})
    except ValidationError as e:
        raise OptkitError(f"{where}: {_first_error(e)}: re-create the artifact") from None


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "the scheme"
    return f"{field}: {first['msg'].removeprefix('Value error, ')} (got {shown(first.get('input'))})"


def dequantized_state_dict(fmt, tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype) -> dict:
    """The format's plain state dict, each quantized linear dequantized with its own scheme."""
    if not is_mixed(quant_config):
        return fmt.dequantized_state_dict(tensors, quant_config, dtype)
    prefixes = [k.removesuffix(f".{fmt.MARKER}") for k in tensors if k.endswith(f".{fmt.MARKER}")]
    schemes = layer_schemes(fmt, quant_config, prefixes)
    return dequantize_layers(
        tensors, fmt.MARKER, fmt.SUFFIXES, lambda prefix: fmt.decompress(prefix, tensors, schemes[prefix]), dtype
    )
