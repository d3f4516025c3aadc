"""`optkit quantize`: turn a model directory into a quantized artifact directory.

The methods live in `methods/` (one folder each), the layer-by-layer walk in `calibrate.py`, the
on-disk layouts in `formats/`. This module chooses, collects per-layer results and writes atomically.
"""

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
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
from optkit.quant import head as output_head
from optkit.quant import methods
from optkit.quant.calibrate import LayerResult, calibrate_layerwise
from optkit.quant.calibration_data import CalibrationOptions, calibration_data
from optkit.quant.formats import format_names, get_format
from optkit.quant.formats.gguf_mix import GgufOptions, check_file_type, with_file_type
from optkit.quant.methods.composition import Composition, resolve
from optkit.quant.methods.rtn.math import weight_error
from optkit.quant.moe import calibration_record as moe_calibration_record
from optkit.quant.sections import check_scheme, check_sections, split_sections
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
    (`smoothquant+gptq`) or, in a recipe, the list of its stages (`[smoothquant, gptq]`). Each
    method's section (`quantize.<its section>`: gptq, awq, smoothquant, fp8, w8a8, a plug-in's) is
    validated by its own options model (sections.py) and read with `section`. Without `weights`,
    a method that fixes its scheme (W8A8) gets that scheme."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "rtn"
    weights: WeightScheme = Field(default_factory=WeightScheme)
    ignore: list[str] = Field(default_factory=list)
    format: str = "compressed-tensors"
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    # mixture-of-experts models: quantize the routers too (by default they stay in full precision)
    quantize_router: bool = False
    # the output head (lm_head): auto (int8 where the format's runtime loads one, else full), full
    # (as stored), int8 or int4 (quant/head.py; a tied head unties); the manifest records the resolved one
    head: str = "auto"
    # `format: gguf`: llama.cpp's file type (Q8_0, F16, ...: formats/gguf_mix.py)
    gguf: GgufOptions | None = Field(None, exclude_if=lambda g: g is None)
    _sections: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @field_validator("method", mode="before")
    @classmethod
    def _registered_method(cls, value):
        return resolve(value).name if isinstance(value, str | list | tuple) else value

    @field_validator("head")
    @classmethod
    def _head_setting(cls, value: str) -> str:
        if value not in output_head.HEAD_SETTINGS:
            raise ValueError(f"unknown head {value!r}: choose one of {', '.join(output_head.HEAD_SETTINGS)}")
        return value

    @field_validator("format")
    @classmethod
    def _registered_format(cls, value: str) -> str:
        if value not in format_names():
            raise ValueError(f"unknown format {value!r}: choose one of {', '.join(format_names())}")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _method_sections(cls, data, handler):
        """Validate each method's section with its own options model; fixed schemes by default."""
        if not isinstance(data, dict):
            return handler(data)
        rest, sections = split_sections(data)
        rest = with_file_type(rest)
        if "weights" not in rest and isinstance(rest.get("method"), str | list | tuple):
            fixed = _fixed_scheme(rest["method"])
            rest = rest if fixed is None else {**rest, "weights": fixed}
        self = handler(rest)
        self._sections = sections
        for method in methods.registered_methods().values():
            if method.resolve is not None:
                self._sections[method.section] = method.resolve(self.section(method), self)
        check_sections(self)
        return self

    @model_serializer(mode="wrap")
    def _dump_sections(self, handler):
        data = handler(self)
        if isinstance(data, dict):
            data.update({key: self.section(key).model_dump() for key in methods.sections()})
        return data

    @model_validator(mode="after")
    def _consistent(self):
        check_scheme(self)
        check_file_type(self.format, self.gguf, self.weights)
        return self

    @property
    def composition(self) -> Composition:
        return resolve(self.method)

    def section(self, method: methods.Method | str) -> BaseModel | None:
        """The options of `method` (or of the section so named): its recipe section, or its defaults."""
        method = methods.sections().get(method) if isinstance(method, str) else method
        if method is None or method.section is None:
            return None
        return self._sections.get(method.section) or method.options()

    @property
    def activations(self) -> str | None:
        """None for weight-only methods; "dynamic" or "static" quantized activations for W8A8."""
        owner = self.composition.activation_stage
        return None if owner is None else owner.activations(self.section(owner))

    @property
    def act_order(self) -> bool | str:
        """How the format must describe the column order: False, "group" (g_idx) or "weight"."""
        for stage in self.composition.stages:
            if stage.act_order is not None:
                return stage.act_order(self.section(stage))
        return False


def _fixed_scheme(method) -> WeightScheme | None:
    """The scheme a method always writes, or None (also for a name that `method` will reject)."""
    try:
        return resolve(method).fixed_weights
    except ValueError:
        return None


def quantize_model(
    model: str | Path, out: Path, options: QuantizeOptions, *, overwrite: bool = False, device: str = "auto"
) -> dict:
    """Quantize `model` into `out` and return the manifest written there.

    One-file formats (GGUF): the artifact is staged in a hidden directory beside `out` (removed
    afterwards, on failure too), then the format writes `out` from it (temporary name, renamed)."""
    fmt = get_format(options.format)
    if getattr(fmt, "SUFFIX", None) is None:  # an artifact directory
        return _quantize_to_dir(model, Path(out), options, overwrite=overwrite, device=device)
    out = Path(out)
    if out.suffix != fmt.SUFFIX or out.is_dir():
        raise OptkitError(f"--format {fmt.NAME} writes one file: give --out NAME{fmt.SUFFIX}")
    if out.is_symlink():
        raise OptkitError(f"--out {out} is a symlink: optkit never replaces one; choose another --out")
    if out.exists() and not overwrite:
        raise OptkitError(f"output {out} already exists: pass --overwrite or choose another --out")
    with scratch_dir(out) as scratch:
        manifest = _quantize_to_dir(model, scratch / "stage", options, overwrite=True, device=device)
        fmt.write_file(scratch / "stage", out, manifest)
    return manifest


@dataclass
class _Model:
    """The base model as quantize_model reads it, checked against the options before any work."""

    base: Path
    config: dict
    hf_config: object
    targets: list[LinearTarget]
    ignored: list[str]


def _checked_model(model: str | Path, options: QuantizeOptions, fmt) -> _Model:
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
    if getattr(fmt, "check_model", None) is not None:  # what the format cannot hold, before calibrating
        fmt.check_model(config_dict, base)
    output_head.check_head(options, fmt, hf_config, outside_decoder_linears(hf_config))
    return _Model(base, config_dict, hf_config, targets, ignored)


def _quantize_to_dir(model: str | Path, out: Path, options: QuantizeOptions, *, overwrite: bool, device: str) -> dict:
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    fmt = get_format(options.format)
    checked = _checked_model(model, options, fmt)
    base, config_dict, hf_config = checked.base, checked.config, checked.hf_config
    asked_head = options.head
    resolved_head = output_head.resolve_head(options, fmt, outside_decoder_linears(hf_config))
    options = options.model_copy(update={"head": resolved_head})
    constrain = getattr(fmt, "constrain", None)  # a format that fixes the stored scales (GGUF's fp16 blocks)
    work = options.model_copy(update={"weights": constrain(options.weights)}) if constrain else options
    linear_schemes = getattr(fmt, "linear_schemes", None)  # per-linear types (GGUF's Q4_K_M raises some)
    schemes = linear_schemes(options, config_dict, base, [t.name for t in checked.targets]) if linear_schemes else {}

    # The temporary output exists from here on; it is renamed to `out` only when complete.
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        with PeakMemory() as peak:
            calibration, layer_results = _quantize_weights(base, checked.targets, work, device, schemes)
            if calibration["name"] is not None:
                calibration |= moe_calibration_record(hf_config.model_type, options.calibration.moe_calibration)
            stats = _write_weights(base, tmp, fmt, work, layer_results)
        head = output_head.head_scheme(options.head, options.weights)
        records = checked.targets + ([output_head.head_target(hf_config)] if head else [])
        layers = [{"name": t.name, "shape": [t.out_features, t.in_features], **stats[t.name]} for t in records]
        config_dict["quantization_config"] = fmt.quantization_config(
            options.weights,
            options.act_order,
            checked.ignored
            + full_precision_gates(hf_config, quantize_router=options.quantize_router)
            + [n for n in outside_decoder_linears(hf_config) if head is None or n != output_head.HEAD],
            options.activations,
        )
        extra = {}
        if head is not None:
            extra = output_head.quantized_head(config_dict, fmt, options, head, tmp, base, hf_config, asked_head)
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
                "ignored_layers": checked.ignored,
                "layers": layers,
                "peak_memory": peak.to_json(),
                "wall_time_s": round(time.perf_counter() - start, 3),
                **extra,
            },
        )
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
    base: Path, targets: list[LinearTarget], options: QuantizeOptions, device: str, schemes: dict[str, WeightScheme]
) -> tuple[dict, Iterator[LayerResult]]:
    """The calibration record, and the quantized layers as they are done (each with its linears'
    (quantized weight, stats) and the full-precision tensors the method changed); `schemes`: the
    linears on another scheme than options.weights."""
    composition = options.composition
    head = output_head.head_scheme(options.head, options.weights)
    if composition.quantize_weight is not None:
        no_calibration = {"name": None, "sha256": "", "num_samples": 0, "seq_len": 0}
        layers = _quantize_data_free(TensorReader(base), targets, options.weights, composition, schemes)
        return no_calibration, output_head.with_head(layers, base, options, head)
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
        device=torch.device(resolve_device_str(device)),
        batch_size=options.calibration.batch_size,
        label=f"{options.method} {options.weights.describe()}",
        moe_calibration=options.calibration.moe_calibration,
        moe_min_tokens=options.calibration.moe_min_tokens,
        then=output_head.gptq_head(options, head, options.calibration.batch_size),
        schemes=schemes,
    )
    return calibration, output_head.with_head(layers, base, options, head)


def _quantize_data_free(
    reader: TensorReader, targets: list[LinearTarget], scheme: WeightScheme, composition: Composition, schemes: dict
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
            own = schemes.get(target.name, scheme)
            qw = quantize_weight(weight, own, scale_dtype=own.scale_dtype_for(weight.dtype))
            stats = weight_error(weight, qw.dequantize())
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
