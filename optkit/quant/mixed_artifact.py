"""An artifact with some linears raised to 8 bits or kept in full precision, made from a uniform one.

Only the raised layers are quantized again, from the base model's weights: 8 bits with round-to-
nearest at the artifact's group size and symmetry (at 8 bits GPTQ and AWQ gain nothing measurable
over RTN, and no calibration pass is needed), or the base's weight as stored for full precision.
Every other tensor is copied as it is. The format's config says which layer has which scheme
(formats/mixed.py), so transformers, vLLM and optkit's runtime load the result as any artifact.
"""

import json
import shutil
from pathlib import Path

import torch

from optkit.artifacts import atomic_output_dir
from optkit.errors import OptkitError
from optkit.manifest import MANIFEST, read_manifest, write_manifest
from optkit.modeldir import TensorReader, read_config
from optkit.quant.formats import get_format
from optkit.quant.formats.mixed import FULL_PRECISION, check_mixed, mixed_quantization_config
from optkit.quant.rtn import rtn_quantize, weight_error
from optkit.safetensors_stream import LazyTensor, lazy_tensors_in, write_safetensors
from optkit.weights.schemes import WeightScheme

WEIGHTS = "model.safetensors"


def artifact_scheme(manifest: dict) -> WeightScheme:
    return WeightScheme.model_validate(manifest["options"]["weights"])


def layer_bytes(shape: list[int], bits: int, scheme: WeightScheme, full_itemsize: int = 2) -> int:
    """Bytes a linear [out, in] takes at `bits` (16: full precision, `full_itemsize` per weight)."""
    out_features, in_features = shape
    if bits >= FULL_PRECISION:
        return out_features * in_features * full_itemsize
    groups = 1 if scheme.group_size == -1 else in_features // scheme.group_size
    zero_points = 0 if scheme.symmetric else out_features * groups * bits // 8
    return out_features * in_features * bits // 8 + out_features * groups * 2 + zero_points


def write_mixed_artifact(source: Path, base: Path, bits: dict[str, int], out: Path, record: dict) -> dict:
    """Write `out`: the artifact `source` with each layer in `bits` at that precision (8 or 16);
    `record` is added to the manifest. Returns the manifest."""
    manifest = read_manifest(source)
    if manifest is None:
        raise OptkitError(f"{source} has no optkit.json: repair starts from an optkit artifact")
    check_mixed(manifest["format"])
    fmt = get_format(manifest["format"])
    config = read_config(source)
    is_w8a8 = getattr(fmt, "is_w8a8", None)
    if is_w8a8 and is_w8a8(config["quantization_config"]):
        raise OptkitError("repair raises weight precision: a W8A8 artifact quantizes activations too")
    scheme = artifact_scheme(manifest)
    if not (source / WEIGHTS).is_file():
        raise OptkitError(f"{source} has no {WEIGHTS}: repair reads single-file optkit artifacts")
    previous = manifest.get("precision_overrides", {})
    bits = {**previous, **bits}
    reader = TensorReader(base)
    tensors: dict[str, LazyTensor | torch.Tensor] = dict(lazy_tensors_in(source / WEIGHTS))
    layers = {layer["name"]: layer for layer in manifest["layers"]}
    for name, b in bits.items():
        if name not in layers:
            raise OptkitError(f"{name} is not a quantized layer of {source}")
        for suffix in (*fmt.SUFFIXES, "weight"):
            tensors.pop(f"{name}.{suffix}", None)
        weight = reader.get(f"{name}.weight")
        if b >= FULL_PRECISION:
            tensors[f"{name}.weight"] = weight
            layers[name] = {**layers[name], "precision": FULL_PRECISION, "rel_error": 0.0, "mse": 0.0}
            continue
        qw = rtn_quantize(weight.float(), scheme.model_copy(update={"bits": b}), _scale_dtype(weight))
        tensors.update(fmt.compress(name, qw, None))
        layers[name] = {**layers[name], "precision": b, **weight_error(weight, qw.dequantize())}
    config["quantization_config"] = mixed_quantization_config(
        manifest["format"], _uniform_config(config["quantization_config"], previous), scheme, bits
    )
    with atomic_output_dir(out, overwrite=True) as tmp:
        write_safetensors(tmp / WEIGHTS, tensors, metadata={"format": "pt"})
        # not sorted: compressed-tensors tries config_groups in order, the raised ones first
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in source.iterdir():
            if path.is_file() and path.name not in (WEIGHTS, "config.json", MANIFEST):
                shutil.copy2(path, tmp / path.name)
        fields = {k: v for k, v in manifest.items() if k not in ("files", "optkit_version", "created", "versions")}
        fields["layers"] = [layers[layer["name"]] for layer in manifest["layers"]]
        fields["precision_overrides"] = dict(sorted(bits.items()))
        written = write_manifest(tmp, {**fields, **record})
    return written


def _uniform_config(quant_config: dict, previous: dict[str, int]) -> dict:
    """The artifact's config before any override (a repaired artifact may be repaired again)."""
    config = {k: v for k, v in quant_config.items() if k != "dynamic"}
    if "config_groups" in config:
        config["config_groups"] = {"group_0": config["config_groups"]["group_0"]}
        config["ignore"] = [name for name in config.get("ignore", []) if name not in previous]
    return config


def _scale_dtype(weight: torch.Tensor) -> torch.dtype:
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
