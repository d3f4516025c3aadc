"""`optkit quantize MODEL --dry-run`: what the pipeline would do, from config.json and the safetensors
headers alone (no tensor is read, no model runs): the family, every linear to quantize grouped as
the layer-by-layer pipeline takes them (the family's true-sequential groups, families/), what
stays in full precision and why, the artifact's expected size and the pipeline's expected peak memory.

The linears, the gates and what lies outside the decoder come from the functions quantize_model uses
(quant/targets.py, on a weightless meta model), so the plan cannot drift from the run. The artifact's
size is exact for the formats that compress per linear: each format compresses four small zero
weights of the same scheme, whose sizes fix the bilinear size law a·out·in + b·out + c·in + d of a
linear, and every other tensor is copied as stored.
"""

import fnmatch
import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from optkit.errors import OptkitError
from optkit.families import Family, family_for
from optkit.modeldir import weight_files
from optkit.quant.methods import Workload

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_HEADER_BYTES = 200  # a safetensors header entry: name, dtype, shape, offsets (JSON)


def read_headers(path: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in the weight files the directory's loader reads
    (modeldir.weight_files), headers only."""
    tensors = {}
    for file in weight_files(path):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        tensors.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return tensors


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _DTYPE_BYTES.get(dtype, 1)


@dataclass
class Kept:
    """Tensors that stay in full precision, of one kind."""

    what: str
    reason: str
    count: int = 0
    bytes: int = 0
    names: list[str] = field(default_factory=list)


@dataclass
class QuantizePlan:
    model: str
    model_type: str
    family: str
    method: str
    scheme: str
    format: str
    # per decoder layer: (prefix, groups of local linear names in the order the pipeline takes them)
    layers: list[tuple[str, list[list[str]]]]
    linears: dict[str, tuple[int, int]]  # full name -> (out_features, in_features)
    kept: list[Kept]
    head: str  # the output head as the run writes it: full, int8 or int4 (`--head auto` resolved)
    head_bytes: int  # the quantized head's bytes (0 for full); a tied base's embedding stays besides
    base_bytes: int
    artifact_bytes: int
    peak_bytes: dict[str, int]  # the pipeline's peak memory, by part, and "total"

    def to_json(self) -> dict:
        return asdict(self)


def plan_quantization(model: str | Path, options) -> QuantizePlan:
    """The plan of `quantize_model(model, out, options)`, with its checks of the model and options."""
    from transformers import AutoConfig

    from optkit.modeldir import read_config, resolve_model_dir
    from optkit.quant.formats import get_format
    from optkit.quant.head import check_head, head_scheme, head_target, resolve_head
    from optkit.quant.targets import decoder_linears, full_precision_gates, outside_decoder_linears, select_targets

    base = resolve_model_dir(model)
    config = read_config(base)
    if "quantization_config" in config:
        raise OptkitError(f"model {base} is already quantized: give its full-precision base model")
    hf_config = AutoConfig.from_pretrained(base, trust_remote_code=False)
    family = family_for(config.get("model_type"))
    targets, ignored = select_targets(
        decoder_linears(hf_config, quantize_router=options.quantize_router), options.ignore
    )
    for target in targets:
        options.weights.check_layer(target.name, target.in_features)
    fmt = get_format(options.format)
    shapes = [(t.name, t.in_features, t.out_features) for t in targets]
    fmt.check(options.weights, options.act_order, shapes, options.activations)
    outside = outside_decoder_linears(hf_config)
    check_head(options, fmt, hf_config, outside)
    setting = resolve_head(options, fmt, outside)
    head = head_scheme(setting, options.weights)
    headers = read_headers(base)
    linears = {t.name: (t.out_features, t.in_features) for t in targets}
    gates = full_precision_gates(hf_config, quantize_router=options.quantize_router)
    kept = _kept(headers, linears, ignored, gates, outside, head_quantized=head is not None)
    size_of = _linear_size_law(fmt, options)
    kept_bytes = sum(k.bytes for k in kept)
    quantized_bytes = sum(size_of(out, inp) for out, inp in linears.values())
    head_bytes = 0
    if head is not None:  # one more linear, on its own scheme; a tied base's embedding is kept too
        target = head_target(hf_config)
        head_bytes = _linear_size_law(fmt, options.model_copy(update={"weights": head}))(
            target.out_features, target.in_features
        )
    artifact = kept_bytes + quantized_bytes + head_bytes
    artifact += _HEADER_BYTES * (len(headers) + 3 * (len(linears) + (head is not None)))
    artifact += sum(p.stat().st_size for p in base.iterdir() if p.is_file() and p.suffix != ".safetensors")
    return QuantizePlan(
        model=str(base),
        model_type=config.get("model_type"),
        family=family.name,
        method=options.method,
        scheme=options.weights.describe(),
        format=options.format,
        layers=_layers(family, linears),
        linears=linears,
        kept=kept,
        head=setting,
        head_bytes=head_bytes,
        base_bytes=sum(_nbytes(*v) for v in headers.values()),
        artifact_bytes=artifact,
        peak_bytes=_peak_bytes(headers, hf_config, linears, _layers(family, linears), options),
    )


def _layers(family: Family, linears: dict[str, tuple[int, int]]) -> list[tuple[str, list[list[str]]]]:
    """Each decoder layer's linears in the family's true-sequential groups (glob patterns allowed,
    as for experts), then any the family does not name, one per group (calibrate.sequential_groups)."""
    by_layer: dict[str, list[str]] = {}
    for name in linears:
        prefix, _, local = name.partition(".layers.")
        index, _, local = local.partition(".")
        by_layer.setdefault(f"{prefix}.layers.{index}", []).append(local)
    layers = []
    for prefix, names in by_layer.items():
        # the family names modules as transformers does (Mixtral's block_sparse_moe is its mlp)
        module = {n: family.module_name(f"{prefix}.{n}").removeprefix(f"{prefix}.") for n in names}
        groups = [
            [n for n in names if any(fnmatch.fnmatchcase(module[n], p) for p in group)]
            for group in family.sequential_groups
        ]
        known = {n for group in groups for n in group}
        layers.append((prefix, [g for g in groups if g] + [[n] for n in names if n not in known]))
    return layers


def _kept(headers, linears, ignored, gates, outside, head_quantized: bool = False) -> list[Kept]:
    """Every tensor that is not a quantized linear's weight (nor, `head_quantized`, the head's),
    by kind, with why it stays as stored."""
    kinds = {
        "ignored": Kept("linears matched by --ignore", "you asked for them to stay in full precision"),
        "gates": Kept("routers and shared-expert gates", "they choose experts rather than compute; tiny"),
        "head": Kept("lm_head", "--head full (auto: where the format's serving runtime reads no quantized head)"),
        "outside": Kept("linears outside the decoder layers", "e.g. a vision tower: copied, never quantized"),
        "embed": Kept("embeddings", "a lookup, not a matmul"),
        "norms": Kept("norms", "vectors; AWQ and SmoothQuant fold their scales into them"),
        "biases": Kept("biases of quantized linears", "added after the matmul, kept in full precision"),
        "other": Kept("other tensors", "not a linear of a decoder layer"),
    }
    ignored, gates = set(ignored), set(gates)
    outside = [n for n in outside if n != "lm_head"]
    for name, (dtype, shape) in headers.items():
        module, _, leaf = name.rpartition(".")
        if (module in linears or head_quantized and module == "lm_head") and leaf == "weight":
            continue
        if module in linears:
            kind = "biases"
        elif module in ignored:
            kind = "ignored"
        elif module in gates:
            kind = "gates"
        elif module.endswith("lm_head"):
            kind = "head"
        elif any(module.startswith(o) or o.endswith(module) for o in outside):
            kind = "outside"
        elif "embed" in module:
            kind = "embed"
        elif "norm" in module and len(shape) == 1:
            kind = "norms"
        else:
            kind = "other"
        kept = kinds[kind]
        kept.count += 1
        kept.bytes += _nbytes(dtype, shape)
        kept.names.append(name)
    return [k for k in kinds.values() if k.count]


def _linear_size_law(fmt, options):
    """bytes(out, in) of one quantized linear in this format: fitted exactly on four small zero
    weights compressed by the format (its sizes are bilinear in out and in), or the scheme's bits
    plus 16-bit scales where the format cannot compress one alone (a whole-file format)."""
    import torch

    from optkit.weights.quantized import QuantizedWeight

    scheme = options.weights
    group = scheme.group_size
    columns = max(group, 64) if group != -1 else 64

    def compressed(out: int, inp: int) -> int:
        groups = 1 if group == -1 else inp // group
        g_idx = torch.arange(inp, dtype=torch.int32) // group if options.act_order == "group" else None
        static = options.activations == "static"
        qw = QuantizedWeight(
            torch.zeros(out, inp, dtype=torch.int8),
            torch.ones(out, groups, dtype=torch.bfloat16),
            torch.zeros(out, groups, dtype=torch.int8),
            scheme,
            g_idx=g_idx,
            input_scale=torch.ones(1) if static else None,
        )
        return sum(t.numel() * t.element_size() for t in fmt.compress("x", qw, options.activations).values())

    try:
        (s11, s12), (s21, s22) = [[compressed(o, i) for i in (columns, 2 * columns)] for o in (64, 128)]
    except Exception:  # noqa: BLE001 - a format that writes whole files: the scheme's own size
        return lambda out, inp: out * inp * scheme.bits // 8 + out * (1 if group == -1 else inp // group) * 2
    a = (s22 - s21 - s12 + s11) / (64 * columns)
    b = (s21 - s11) / 64 - a * columns
    c = (s12 - s11) / columns - a * 64
    d = s11 - a * 64 * columns - b * 64 - c * columns
    return lambda out, inp: round(a * out * inp + b * out + c * inp + d)


def _peak_bytes(headers, hf_config, linears, layers, options) -> dict[str, int]:
    """The pipeline's peak memory, part by part: the live tensors at the worst moment, in bytes.
    What the process adds beyond them (bench/plan_memory.py, docs/results.md): once per process
    ~5-30 MB of modules, tokenizer and torch's set-up, whatever the model; and on glibc's default
    settings the heap pages it keeps after freeing weight-sized tensors (how much: docs/results.md).

    Calibrated methods (quant/calibrate.py): the cached inputs of the layer being calibrated
    (fp32, CPU), one decoder layer in fp32, and the working set of its worst group. Data-free
    methods (RTN) read one weight at a time. Both then stream the checkpoint out one stored tensor
    at a time (safetensors_stream.py), after calibration has let go of its cache."""
    write = max((_nbytes(*v) for v in headers.values()), default=0)  # the largest tensor, as stored
    largest = max(linears.values(), key=lambda s: s[0] * s[1], default=(0, 0))
    weight = largest[0] * largest[1]  # elements of the largest linear
    composition = options.composition
    if composition.quantize_weight is not None:
        # one weight: stored (≤ 4 B), in fp32 (4 B), its integers (1 B), dequantized for the error (4 B)
        one_weight = 13 * weight
        return {"one_weight": one_weight, "write": write, "total": max(one_weight, write)}
    layer_bytes: dict[str, int] = {}
    for name, (_, shape) in headers.items():
        if ".layers." in name:
            prefix, _, rest = name.partition(".layers.")
            key = f"{prefix}.layers.{rest.partition('.')[0]}"
            layer_bytes[key] = layer_bytes.get(key, 0) + _nbytes("F32", shape)
    text = getattr(hf_config, "text_config", None) or hf_config
    calibration = options.calibration
    cache = 4 * calibration.num_samples * calibration.seq_len * text.hidden_size
    layer = max(layer_bytes.values(), default=0)
    # a forward of one batch: the widest linear's output 3 times (an MLP's gate, up and their
    # product) and the attention scores [heads, L, L] where they are materialised (eager)
    heads = getattr(text, "num_attention_heads", 1)
    widest_out = max((o for o, _ in linears.values()), default=0)
    batch_tokens = calibration.batch_size * calibration.seq_len
    working = 4 * batch_tokens * (3 * widest_out + heads * calibration.seq_len)
    # the layer's quantized integers (1 B per weight) until the layer is handed on, and beside the
    # weight being quantized: its fp32 working copy, its RTN reference, the dequantized result and
    # the error (4 fp32 copies)
    layer_weights = [
        sum(o * i for o, i in (linears[f"{prefix}.{n}"] for g in groups for n in g)) for prefix, groups in layers
    ]
    working += max(layer_weights, default=0) + 4 * 4 * weight
    workload = Workload(linears, layers, text.hidden_size, calibration.num_samples, calibration.seq_len)
    # each stage's own working set (GPTQ's Hessians, a scale search's inputs); a composition
    # (smoothquant+gptq) smooths, then quantizes: the larger of the two
    stages = [s for s in composition.stages if s.memory is not None]
    working += max((s.memory(options.section(s), workload) for s in stages), default=0)
    return {
        "calibration_inputs": cache,
        "decoder_layer": layer,
        "working_set": working,
        "write": write,
        "total": max(cache + layer + working, write),
    }
