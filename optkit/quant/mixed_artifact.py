"""An artifact with some linears on other rungs of the ladder (quant/ladder.py: more bits, a finer
group, full precision), made from a uniform one.

Only the raised layers are quantized again, from the base model's weights: round-to-nearest at the
rung's bits and group size and the artifact's symmetry (no calibration pass is needed; at 8 bits GPTQ
and AWQ gain nothing measurable over RTN, at 4 bits they would: a GPTQ artifact's raised 4-bit layers
are RTN), or the base's weight as stored for full precision.
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
from optkit.quant.formats.mixed import check_mixed, mixed_quantization_config
from optkit.quant.head import base_linear_weight
from optkit.quant.ladder import Rung, parse_rung
from optkit.quant.methods.rtn.math import rtn_quantize, weight_error
from optkit.safetensors_stream import LazyTensor, lazy_tensors_in, write_safetensors
from optkit.weights.schemes import WeightScheme

WEIGHTS = "model.safetensors"


def artifact_scheme(manifest: dict) -> WeightScheme:
    return WeightScheme.model_validate(manifest["options"]["weights"])


def overrides(manifest: dict) -> dict[str, Rung]:
    """Each layer a previous repair moved off the artifact's scheme, on its rung (older manifests
    hold a bare 8 or 16)."""
    scheme = artifact_scheme(manifest)
    return {name: parse_rung(value).resolve(scheme) for name, value in manifest.get("precision_overrides", {}).items()}


def layer_rungs(manifest: dict) -> dict[str, Rung]:
    """The rung of every quantized linear of an artifact (of a GGUF file: its ggml type, `gguf_type`)."""
    uniform = Rung.of(artifact_scheme(manifest))
    on = {
        layer["name"]: Rung.gguf(layer["gguf_type"]) if "gguf_type" in layer else uniform
        for layer in manifest["layers"]
    }
    return {**on, **overrides(manifest)}


def write_mixed_artifact(source: Path, base: Path, rungs: dict[str, Rung | int | str], out: Path, record: dict) -> dict:
    """Write `out`: the artifact `source` with each layer of `rungs` on that rung (a `Rung`, or what
    `parse_rung` reads: 8, 16, 'w4g32'); `record` is added to the manifest. Returns the manifest."""
    manifest = read_manifest(source)
    if manifest is None:
        raise OptkitError(f"{source} has no optkit.json: repair starts from an optkit artifact")
    check_mixed(manifest["format"])
    fmt = get_format(manifest["format"])
    config = read_config(source)
    if fmt.is_w8a8(config["quantization_config"]):
        raise OptkitError("repair raises weight precision: a W8A8 artifact quantizes activations too")
    scheme = artifact_scheme(manifest)
    if not (source / WEIGHTS).is_file():
        raise OptkitError(f"{source} has no {WEIGHTS}: repair reads single-file optkit artifacts")
    previous = overrides(manifest)
    rungs = {**previous, **{name: _rung(r).resolve(scheme) for name, r in rungs.items()}}
    reader = TensorReader(base)
    tensors: dict[str, LazyTensor | torch.Tensor] = dict(lazy_tensors_in(source / WEIGHTS))
    layers = {layer["name"]: layer for layer in manifest["layers"]}
    for name, rung in rungs.items():
        if name not in layers:
            raise OptkitError(f"{name} is not a quantized layer of {source}")
        if not rung.fits(layers[name]["shape"][1]):
            raise OptkitError(f"{rung.label}: its group size does not divide the input features of {name}")
        if name in previous and previous[name] == rung:
            continue  # on this rung already: its tensors are in `source`
        for suffix in (*fmt.SUFFIXES, "weight"):
            tensors.pop(f"{name}.{suffix}", None)
        weight = base_linear_weight(reader, name)  # a tied head: the embedding
        if rung.full:
            tensors[f"{name}.weight"] = weight
            layers[name] = {**layers[name], "precision": rung.to_json(), "rel_error": 0.0, "mse": 0.0}
            continue
        raised = rung.scheme(scheme)
        qw = rtn_quantize(weight.float(), raised, raised.scale_dtype_for(weight.dtype))
        tensors.update(fmt.compress(name, qw, None))
        layers[name] = {**layers[name], "precision": rung.to_json(), **weight_error(weight, qw.dequantize())}
    config["quantization_config"] = mixed_quantization_config(
        manifest["format"], _uniform_config(config["quantization_config"], previous), scheme, rungs
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
        fields["precision_overrides"] = {name: rung.to_json() for name, rung in sorted(rungs.items())}
        written = write_manifest(tmp, {**fields, **record})
    return written


def _rung(value: Rung | int | str) -> Rung:
    return value if isinstance(value, Rung) else parse_rung(value)


def _uniform_config(quant_config: dict, previous: dict[str, Rung]) -> dict:
    """The artifact's config before any override (a repaired artifact may be repaired again)."""
    config = {k: v for k, v in quant_config.items() if k != "dynamic"}
    if "config_groups" in config:
        config["config_groups"] = {"group_0": config["config_groups"]["group_0"]}
        config["ignore"] = [name for name in config.get("ignore", []) if name not in previous]
    return config
