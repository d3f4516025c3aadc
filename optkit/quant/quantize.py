"""`optkit quantize`: turn a model directory into a quantized artifact directory.

The math lives in `rtn.py` and `gptq.py`, the layer-by-layer walk in `calibrate.py`, the on-disk
layouts in `formats/`. This module chooses, collects per-layer results and writes atomically.
"""

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from safetensors.torch import save_file

from optkit.artifacts import atomic_output_dir, check_output_dir, content_sha256, scratch_dir
from optkit.devices import resolve_device as resolve_device_str
from optkit.errors import OptkitError
from optkit.manifest import MANIFEST, confined_file, write_manifest
from optkit.memory import PeakMemory
from optkit.modeldir import TensorReader, load_tokenizer, read_config, resolve_model_dir, verify_weights, weight_files
from optkit.progress import progress_bar
from optkit.quant import methods, rtn
from optkit.quant.awq_layer import AWQOptions
from optkit.quant.calibrate import LayerResult, calibrate_layerwise
from optkit.quant.calibration_data import CalibrationOptions, calibration_data
from optkit.quant.formats import format_names, get_format
from optkit.quant.gptq import GPTQOptions
from optkit.quant.moe import calibration_record as moe_calibration_record
from optkit.quant.smoothquant_layer import SmoothQuantOptions
from optkit.quant.targets import (
    LinearTarget,
    decoder_linears,
    full_precision_gates,
    outside_decoder_linears,
    select_targets,
)
from optkit.safetensors_stream import LazyTensor, lazy_tensors_in, write_safetensors
from optkit.weights.schemes import WeightScheme


class QuantizeOptions(BaseModel):
    """Everything that decides the artifact's weights; the field names are the recipe keys.

    `method` is a registered method (quant/methods/), a composition's canonical name
    (`smoothquant+gptq`) or, in a recipe, the list of its stages (`[smoothquant, gptq]`). The
    built-in methods' sections are declared here, as every optkit.json records them; a plug-in
    method's section (`quantize.<its section>`) is validated by its own options model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "rtn"
    weights: WeightScheme = Field(default_factory=WeightScheme)
    ignore: list[str] = Field(default_factory=list)
    format: str = "compressed-tensors"
    gptq: GPTQOptions = Field(default_factory=GPTQOptions)
    awq: AWQOptions = Field(default_factory=AWQOptions)
    smoothquant: SmoothQuantOptions = Field(default_factory=SmoothQuantOptions)
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    # mixture-of-experts models: quantize the routers too (by default they stay in full precision)
    quantize_router: bool = False
    _plugin_sections: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @field_validator("method", mode="before")
    @classmethod
    def _registered_method(cls, value):
        if isinstance(value, list | tuple):
            return methods.compose(value).name
        return methods.resolve(value).name if isinstance(value, str) else value

    @field_validator("format")
    @classmethod
    def _registered_format(cls, value: str) -> str:
        if value not in format_names():
            raise ValueError(f"unknown format {value!r}: choose one of {', '.join(format_names())}")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _plugin_method_sections(cls, data, handler):
        """Validate the sections of plug-in methods with their own options models."""
        if not isinstance(data, dict):
            return handler(data)
        registered = methods.registered_methods().values()
        plugins = {m.section: m for m in registered if m.options and m.section not in cls.model_fields}
        sections = {}
        for key in [k for k in data if k in plugins]:
            try:
                sections[key] = plugins[key].options.model_validate(data[key] or {})
            except ValidationError as e:
                error = e.errors()[0]
                where = ".".join(str(p) for p in (key, *error["loc"]))
                raise ValueError(f"{where}: {error['msg'].removeprefix('Value error, ')}") from None
        self = handler({k: v for k, v in data.items() if k not in plugins})
        for stage in self.composition.stages:
            if stage.section in plugins and stage.section not in sections:
                sections[stage.section] = stage.options()
        self._plugin_sections = sections
        return self

    @model_serializer(mode="wrap")
    def _dump_plugin_sections(self, handler):
        data = handler(self)
        if isinstance(data, dict):
            data.update({k: v.model_dump() for k, v in self._plugin_sections.items()})
        return data

    @model_validator(mode="after")
    def _consistent(self):
        composition = self.composition
        fixed = composition.fixed_weights
        if fixed is not None and self.weights != fixed:
            raise ValueError(
                f"{self.method} quantizes weights to {_fixed_words(fixed)} (bits {fixed.bits}, "
                f"group_size {fixed.group_size}, {'symmetric' if fixed.symmetric else 'asymmetric'}"
                f"{'' if fixed.type == 'int' else ', type ' + fixed.type}): leave the weight scheme at that"
            )
        weight_type = composition.weights.weight_type if composition.weights is not None else "int"
        if fixed is None and self.weights.type != weight_type:
            registered = methods.registered_methods().values()
            writes = {m.name: (m.weight_type, getattr(m.fixed_weights, "type", None)) for m in registered}
            writers = [name for name, types in writes.items() if self.weights.type in types]
            raise ValueError(
                f"method {self.method} writes weights.type {weight_type}, not {self.weights.type}"
                f"{' (written by method ' + ' or '.join(writers) + ')' if writers else ''}: "
                f"set weights.type {weight_type} or change the method"
            )
        for stage in composition.stages:
            if stage.bits is not None and self.weights.bits not in stage.bits:
                raise ValueError(
                    f"{stage.name} quantizes to {', '.join(map(str, stage.bits))} bits, not {self.weights.bits}"
                )
        # GPTQ settings left unset take the format's defaults (GGUF Q4_0: act-order, static groups and
        # llama.cpp's scale rule), else the plain ones; what is recorded is what ran
        defaults = get_format(self.format).gptq_defaults(self.weights) if composition.uses("gptq") else None
        object.__setattr__(self, "gptq", self.gptq.resolved(defaults))
        for method in methods.registered_methods().values():
            if method.unused is not None and not composition.uses(method.name):
                problem = method.unused(self.section(method))
                if problem:
                    raise ValueError(problem)
        return self

    @property
    def composition(self) -> methods.Composition:
        return methods.resolve(self.method)

    def section(self, method: methods.Method) -> BaseModel | None:
        """The options of `method` (its recipe section)."""
        if method.section is None:
            return None
        if method.section in type(self).model_fields:
            return getattr(self, method.section)
        return self._plugin_sections.get(method.section) or method.options()

    @property
    def activations(self) -> str | None:
        """None for weight-only methods; "dynamic" or "static" int8 activations for W8A8."""
        for stage in self.composition.stages:
            if stage.activations is not None:
                return stage.activations(self)
        return None

    @property
    def act_order(self) -> bool | str:
        """How the format must describe the column order: False, "group" (g_idx) or "weight"."""
        for stage in self.composition.stages:
            if stage.act_order is not None:
                return stage.act_order(self.section(stage))
        return False


def _fixed_words(scheme: WeightScheme) -> str:
    """How a fixed scheme reads in an error: "int8 per output channel", "fp8 e4m3 per output channel"."""
    kind = {"int": f"int{scheme.bits}", "float": "fp8 e4m3", "nf4": "nf4"}[scheme.type]
    return f"{kind} per output channel" if scheme.group_size == -1 else f"{kind} in blocks of {scheme.group_size}"


def resolve_device(device: str) -> torch.device:
    """`--device` as a torch device ("auto" and the checks: optkit/devices.py)."""
    return torch.device(resolve_device_str(device))


def quantize_model(
    model: str | Path,
    out: Path,
    options: QuantizeOptions,
    *,
    overwrite: bool = False,
    device: str = "auto",
    _staging: bool = False,
) -> dict:
    """Quantize `model` into `out` and return the manifest written there."""
    if get_format(options.format).SUFFIX is not None and not _staging:
        return _quantize_to_file(model, Path(out), options, overwrite=overwrite, device=device)
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    base = resolve_model_dir(model)
    verify_weights(base)
    config_dict = read_config(base)
    if "quantization_config" in config_dict:
        raise OptkitError(f"model {base} is already quantized: give its full-precision base model")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(base, trust_remote_code=False)
    targets, ignored = select_targets(
        decoder_linears(hf_config, quantize_router=options.quantize_router), options.ignore
    )
    for target in targets:
        options.weights.check_layer(target.name, target.in_features)
    fmt = get_format(options.format)
    fmt.check(
        options.weights,
        options.act_order,
        [(t.name, t.in_features, t.out_features) for t in targets],
        options.activations,
    )
    for stage in options.composition.stages:
        if stage.formats is not None and options.format not in stage.formats:
            raise OptkitError(
                f"--method {stage.name} cannot be written as --format {options.format}: "
                f"use --format {' or '.join(stage.formats)}"
            )
    fmt.check_model(config_dict, base)  # what the format cannot hold, before calibrating
    work = options.model_copy(update={"weights": fmt.constrain(options.weights)})  # GGUF: its fp16 blocks' scales

    # The temporary output exists from here on; it is renamed to `out` only when complete.
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        with PeakMemory() as peak:
            calibration, layer_results = _quantize_weights(base, targets, work, device)
            if calibration["name"] is not None:
                calibration |= moe_calibration_record(hf_config.model_type, options.calibration.moe_calibration)
            stats = _write_weights(base, tmp, fmt, work, layer_results)
        layers = [{"name": t.name, "shape": [t.out_features, t.in_features], **stats[t.name]} for t in targets]
        config_dict["quantization_config"] = fmt.quantization_config(
            options.weights,
            options.act_order,
            ignored
            + full_precision_gates(hf_config, quantize_router=options.quantize_router)
            + outside_decoder_linears(hf_config),
            options.activations,
        )
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        _copy_side_files(base, tmp)
        manifest = write_manifest(
            tmp,
            {
                "method": options.method,
                "options": options.model_dump(),
                "format": options.format,
                "base_model": {"path": str(base.resolve()), "sha256": content_sha256(base)},
                "calibration": calibration,
                "ignored_layers": ignored,
                "layers": layers,
                "peak_memory": peak.to_json(),
                "wall_time_s": round(time.perf_counter() - start, 3),
            },
        )
    return manifest


def _quantize_to_file(model: str | Path, out: Path, options: QuantizeOptions, *, overwrite: bool, device: str) -> dict:
    """One-file formats (GGUF): the artifact is staged in a hidden directory beside `out` (removed
    afterwards, on failure too), then the format writes `out` from it (temporary name, renamed)."""
    fmt = get_format(options.format)
    if out.suffix != fmt.SUFFIX or out.is_dir():
        raise OptkitError(f"--format {fmt.NAME} writes one file: give --out NAME{fmt.SUFFIX}")
    if out.is_symlink():
        raise OptkitError(f"--out {out} is a symlink: optkit never replaces one; choose another --out")
    if out.exists() and not overwrite:
        raise OptkitError(f"output {out} already exists: pass --overwrite or choose another --out")
    with scratch_dir(out) as scratch:
        manifest = quantize_model(model, scratch / "stage", options, overwrite=True, device=device, _staging=True)
        fmt.write_file(scratch / "stage", out, manifest)
    return manifest


def _write_weights(
    base: Path, tmp: Path, fmt, options: QuantizeOptions, layer_results: Iterator[LayerResult]
) -> dict[str, dict]:
    """Write `model.safetensors` into `tmp`: the base model's tensors with each quantized linear
    in the format's layout. Returns the stats of each quantized linear.

    Each layer's compressed tensors go to a spill file in `tmp` as soon as the layer is done, and
    the checkpoint is then written tensor by tensor from the spill files and the base model's
    files: neither the quantized model nor the base model is ever held in memory at once."""
    spill = tmp / ".layers"
    spill.mkdir()
    stats: dict[str, dict] = {}
    compressed: dict[str, LazyTensor] = {}
    updated: dict[str, torch.Tensor] = {}  # e.g. norms that absorbed AWQ scales
    for part, layer in enumerate(layer_results):
        layer_tensors = {}
        for name, (qw, layer_stats) in layer.quantized.items():
            layer_tensors.update(fmt.compress(name, qw, options.activations))
            stats[name] = layer_stats
        file = spill / f"{part:05d}.safetensors"
        save_file(layer_tensors, file)
        compressed.update(lazy_tensors_in(file))
        updated.update(layer.updated)
        del layer, layer_tensors
    replaced = {f"{name}.weight" for name in stats}
    tensors: dict[str, LazyTensor | torch.Tensor] = {}
    for file in weight_files(base):
        for key, tensor in lazy_tensors_in(file).items():
            if key in replaced:
                continue
            tensors[key] = updated[key].to(tensor.dtype) if key in updated else tensor
    tensors.update(compressed)
    with progress_bar() as bar:
        total_mb = sum(t.nbytes for t in tensors.values()) / 2**20
        task = bar.add_task("write model.safetensors", total=round(total_mb, 1), info="MB")
        write_safetensors(
            tmp / "model.safetensors",
            tensors,
            metadata={"format": "pt"},
            on_written=lambda name, nbytes: bar.update(task, advance=nbytes / 2**20),
        )
    shutil.rmtree(spill)
    return stats


def _quantize_weights(
    base: Path, targets: list[LinearTarget], options: QuantizeOptions, device: str
) -> tuple[dict, Iterator[LayerResult]]:
    """The calibration record, and the quantized layers as they are done (each with its linears'
    (quantized weight, stats) and the full-precision tensors the method changed)."""
    composition = options.composition
    if composition.quantize_weight is not None:
        no_calibration = {"name": None, "sha256": "", "num_samples": 0, "seq_len": 0}
        layers = _quantize_data_free(TensorReader(base), targets, options.weights, composition)
        return no_calibration, layers
    data = calibration_data(load_tokenizer(base), options.calibration)
    calibration = {
        "name": options.calibration.calib,
        "sha256": data.source.sha256,
        "num_samples": options.calibration.num_samples,
        "seq_len": options.calibration.seq_len,
    }
    layers = calibrate_layerwise(
        base,
        data.tokens,
        {t.name for t in targets},
        composition.procedure(options),
        device=resolve_device(device),
        batch_size=options.calibration.batch_size,
        label=f"{options.method} {options.weights.describe()}",
        moe_calibration=options.calibration.moe_calibration,
        moe_min_tokens=options.calibration.moe_min_tokens,
    )
    return calibration, layers


def _scale_dtype(weight: torch.Tensor) -> torch.dtype:
    """Scales are stored in the checkpoint's half dtype (bf16 for fp32 checkpoints)."""
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _quantize_data_free(
    reader: TensorReader, targets: list[LinearTarget], scheme: WeightScheme, composition: methods.Composition
) -> Iterator[LayerResult]:
    """One result per linear: RTN (or another data-free method) needs no calibration, so each
    weight is read, quantized and let go."""
    quantize_weight = composition.quantize_weight
    with progress_bar() as bar:
        task = bar.add_task(f"{composition.name} {scheme.describe()}", total=len(targets), info="")
        for target in targets:
            weight = reader.get(f"{target.name}.weight")
            if not torch.isfinite(weight).all():
                raise OptkitError(
                    f"{target.name}: the weight contains NaN or inf: repair the checkpoint before quantizing"
                )
            qw = quantize_weight(weight, scheme, scale_dtype=_scale_dtype(weight))
            stats = rtn.weight_error(weight, qw.dequantize())
            bar.update(task, advance=1, info=f"{target.name}  rel.err {stats['rel_error']:.4f}")
            yield LayerResult(target.name, {target.name: (qw, stats)}, {})


def _copy_side_files(base: Path, out: Path) -> None:
    """Tokenizer, generation config and the like: everything but weights (any *.safetensors: the
    artifact's own are written above), config and manifest; only files inside `base`."""
    skip = {"config.json", MANIFEST, "model.safetensors.index.json"}
    for path in base.iterdir():
        if path.name in skip or path.name.endswith(".safetensors"):
            continue
        source = confined_file(base, path.name) if path.is_file() else None
        if source is not None:
            shutil.copy2(source, out / path.name)


__all__ = ["QuantizeOptions", "quantize_model"]
