"""`optkit quantize`: turn a model directory into a quantized artifact directory.

The math lives in `rtn.py` and `gptq.py`, the layer-by-layer walk in `calibrate.py`, the on-disk
layouts in `formats/`. This module chooses, collects per-layer results and writes atomically.
"""

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors.torch import save_file

from optkit.artifacts import atomic_output_dir, check_output_dir, content_sha256
from optkit.devices import resolve_device as resolve_device_str
from optkit.errors import OptkitError
from optkit.manifest import MANIFEST, write_manifest
from optkit.memory import PeakMemory
from optkit.modeldir import TensorReader, load_tokenizer, read_config, resolve_model_dir, verify_weights, weight_files
from optkit.progress import progress_bar
from optkit.quant import rtn
from optkit.quant.awq_layer import AWQOptions, awq_procedure
from optkit.quant.calibrate import (
    CalibrationOptions,
    LayerProcedure,
    LayerResult,
    calibrate_layerwise,
    calibration_data,
)
from optkit.quant.formats import FORMATS, get_format
from optkit.quant.gptq import GPTQOptions
from optkit.quant.procedures import gptq_procedure
from optkit.quant.smoothquant import W8_PER_CHANNEL
from optkit.quant.smoothquant_layer import SmoothQuantOptions, smoothquant_procedure
from optkit.quant.targets import LinearTarget, decoder_linears, select_targets
from optkit.safetensors_stream import LazyTensor, lazy_tensors_in, write_safetensors
from optkit.weights.schemes import WeightScheme

Method = Literal["rtn", "gptq", "awq", "w8a8", "smoothquant", "smoothquant+gptq"]
METHODS = get_args(Method)
W8A8_METHODS = ("w8a8", "smoothquant", "smoothquant+gptq")


class QuantizeOptions(BaseModel):
    """Everything that decides the artifact's weights; the field names are the recipe keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Method = "rtn"
    weights: WeightScheme = Field(default_factory=WeightScheme)
    ignore: list[str] = Field(default_factory=list)
    format: Literal["compressed-tensors", "gptq", "awq"] = "compressed-tensors"
    gptq: GPTQOptions = Field(default_factory=GPTQOptions)
    awq: AWQOptions = Field(default_factory=AWQOptions)
    smoothquant: SmoothQuantOptions = Field(default_factory=SmoothQuantOptions)
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)

    @model_validator(mode="after")
    def _consistent(self):
        if self.method in W8A8_METHODS and self.weights != W8_PER_CHANNEL:
            raise ValueError(
                f"{self.method} quantizes weights to int8 per output channel (bits 8, group_size -1, "
                "symmetric): leave the weight scheme at that"
            )
        if not self.method.endswith("gptq") and (self.gptq.act_order or self.gptq.static_groups):
            raise ValueError("act_order and static_groups are GPTQ options: use them with method gptq")
        return self

    @property
    def activations(self) -> str | None:
        """None for weight-only methods; "dynamic" or "static" int8 activations for W8A8."""
        return self.smoothquant.activations if self.method in W8A8_METHODS else None

    @property
    def act_order(self) -> bool | str:
        """How the format must describe the column order: False, "group" (g_idx) or "weight"."""
        if not self.method.endswith("gptq") or not self.gptq.act_order:
            return False
        return "weight" if self.gptq.static_groups else "group"


def resolve_device(device: str) -> torch.device:
    """`--device` as a torch device ("auto" and the checks: optkit/devices.py)."""
    return torch.device(resolve_device_str(device))


def quantize_model(
    model: str | Path, out: Path, options: QuantizeOptions, *, overwrite: bool = False, device: str = "auto"
) -> dict:
    """Quantize `model` into `out` and return the manifest written there."""
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    base = resolve_model_dir(model)
    verify_weights(base)
    config_dict = read_config(base)
    if "quantization_config" in config_dict:
        raise OptkitError(f"model {base} is already quantized: give its full-precision base model")
    from transformers import AutoConfig

    targets, ignored = select_targets(decoder_linears(AutoConfig.from_pretrained(base)), options.ignore)
    for target in targets:
        options.weights.check_layer(target.name, target.in_features)
    fmt = get_format(options.format)
    fmt.check(
        options.weights,
        options.act_order,
        [(t.name, t.in_features, t.out_features) for t in targets],
        options.activations,
    )

    # The temporary output exists from here on; it is renamed to `out` only when complete.
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        with PeakMemory() as peak:
            calibration, layer_results = _quantize_weights(base, targets, options, device)
            stats = _write_weights(base, tmp, fmt, options, layer_results)
        layers = [{"name": t.name, "shape": [t.out_features, t.in_features], **stats[t.name]} for t in targets]
        config_dict["quantization_config"] = fmt.quantization_config(
            options.weights, options.act_order, ignored + ["lm_head"], options.activations
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
    if options.method == "rtn":
        no_calibration = {"name": None, "sha256": "", "num_samples": 0, "seq_len": 0}
        return no_calibration, _quantize_rtn(TensorReader(base), targets, options.weights)
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
        _procedure(options),
        device=resolve_device(device),
        batch_size=options.calibration.batch_size,
        label=f"{options.method} {options.weights.describe()}",
    )
    return calibration, layers


def _procedure(options: QuantizeOptions) -> LayerProcedure:
    if options.method == "gptq":
        return gptq_procedure(options.weights, options.gptq)
    if options.method == "awq":
        return awq_procedure(options.weights, options.awq)
    smoothquant = options.smoothquant
    if options.method == "w8a8":
        smoothquant = smoothquant.model_copy(update={"smooth": False})
    weights = "gptq" if options.method == "smoothquant+gptq" else "rtn"
    return smoothquant_procedure(smoothquant, weights, options.gptq)


def _scale_dtype(weight: torch.Tensor) -> torch.dtype:
    """Scales are stored in the checkpoint's half dtype (bf16 for fp32 checkpoints)."""
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _quantize_rtn(reader: TensorReader, targets: list[LinearTarget], scheme: WeightScheme) -> Iterator[LayerResult]:
    """One result per linear: RTN needs no calibration, so each weight is read, rounded and let go."""
    with progress_bar() as bar:
        task = bar.add_task(f"rtn {scheme.describe()}", total=len(targets), info="")
        for target in targets:
            weight = reader.get(f"{target.name}.weight")
            if not torch.isfinite(weight).all():
                raise OptkitError(
                    f"{target.name}: the weight contains NaN or inf: repair the checkpoint before quantizing"
                )
            qw = rtn.rtn_quantize(weight, scheme, scale_dtype=_scale_dtype(weight))
            stats = rtn.weight_error(weight, qw.dequantize())
            bar.update(task, advance=1, info=f"{target.name}  rel.err {stats['rel_error']:.4f}")
            yield LayerResult(target.name, {target.name: (qw, stats)}, {})


def _copy_side_files(base: Path, out: Path) -> None:
    """Tokenizer, generation config and the like: everything but weights, config and manifest."""
    skip = {"config.json", MANIFEST, "model.safetensors.index.json"} | {p.name for p in weight_files(base)}
    for path in base.iterdir():
        if path.is_file() and path.name not in skip:
            shutil.copy2(path, out / path.name)


__all__ = ["FORMATS", "METHODS", "QuantizeOptions", "quantize_model"]
