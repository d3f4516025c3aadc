"""A GGUF file with some linears raised along ggml's types (quant/ladder.py's GGUF_LADDER: Q2_K <
Q3_K < Q4_K < Q5_K < Q6_K < Q8_0 < full precision), made from a file optkit wrote: what repair
(pipeline/repair.py) gates, the GGUF counterpart of quant/mixed_artifact.py.

Only the raised linears are quantized again, from the base model's weights, by round-to-nearest
onto the new type's grid (for a K type the super-block grid fitted as llama.cpp fits it without an
importance matrix, weights/kquants; for Q8_0 fp16 block scales), so the bytes dequantize to exactly
the weights that were chosen; full precision is the base's weight in its dtype (F16, BF16, F32), as
the converter writes it. Every other tensor and metadata key is copied byte for byte; the manifest
(`optkit.manifest`) gains each raised layer's `gguf_type`, `precision` and weight error and the
`precision_overrides`. The file is written to a temporary name beside `out` and renamed into place.
"""

import datetime
from pathlib import Path

import numpy as np
import torch

from optkit import __version__
from optkit.artifacts import atomic_output_file
from optkit.errors import OptkitError
from optkit.families import family_for
from optkit.json_strict import dumps, finite
from optkit.manifest import versions
from optkit.modeldir import TensorReader, read_config
from optkit.quant.formats import gguf as gguf_format
from optkit.quant.formats import gguf_metadata as meta
from optkit.quant.formats.gguf_check import open_checked
from optkit.quant.formats.gguf_hparams import optkit_manifest
from optkit.quant.formats.gguf_plan import gguf_name
from optkit.quant.formats.gguf_types import tensor_bytes
from optkit.quant.head import base_linear_weight
from optkit.quant.ladder import Rung, parse_rung
from optkit.quant.methods.rtn.math import rtn_quantize, weight_error
from optkit.weights.schemes import WeightScheme

MANIFEST_KEY = "optkit.manifest"
FULL_TYPES = {torch.float16: "F16", torch.bfloat16: "BF16"}  # any other dtype: F32


def gguf_manifest(path: Path) -> dict | None:
    """The manifest optkit wrote into a .gguf (`optkit.manifest`), or None."""
    return optkit_manifest(open_checked(path))


def write_mixed_gguf(source: Path, base: Path, rungs: dict[str, Rung], out: Path, record: dict) -> dict:
    """Write `out`: the .gguf `source` with each linear of `rungs` on that rung (its ggml type);
    `record` is added to the manifest. Returns the manifest written into the file."""
    manifest = gguf_manifest(source)
    if manifest is None or not manifest.get("layers") or manifest["options"].get("gguf") is None:
        raise OptkitError(f"{source} has no optkit manifest with a GGUF file type: repair starts from optkit's file")
    previous = {name: parse_rung(value) for name, value in manifest.get("precision_overrides", {}).items()}
    rungs = {**previous, **rungs}
    config = read_config(base)
    layers = {layer["name"]: layer for layer in manifest["layers"]}
    reader = TensorReader(base)
    raised = {}  # GGUF tensor name -> (bytes as gguf-py shapes them, raw ggml type)
    for name, rung in rungs.items():
        if name not in layers:
            raise OptkitError(f"{name} is not a quantized layer of {source}")
        if rung.gguf_type is None and not rung.full:
            raise OptkitError(f"{rung.label}: a GGUF linear climbs ggml's types (Q2_K ... Q8_0, 16)")
        if not rung.fits(layers[name]["shape"][1]):
            raise OptkitError(f"{rung.label}: its blocks do not divide the input features of {name}")
        if previous.get(name) == rung:
            continue  # on this rung already: its tensor is in `source`
        tensor_name, data, raw_type, error = _raised_tensor(name, rung, reader, config)
        raised[tensor_name] = (data, raw_type)
        layers[name] = {**layers[name], "gguf_type": raw_type.name, "precision": rung.to_json(), **error}
    fields = {k: v for k, v in manifest.items() if k not in ("files", "optkit_version", "created", "versions")}
    fields["layers"] = [layers[layer["name"]] for layer in manifest["layers"]]
    fields["precision_overrides"] = {name: rung.to_json() for name, rung in sorted(rungs.items())}
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    written = finite({"optkit_version": __version__, "created": stamp, "versions": versions(), **fields, **record})
    _copy_with(source, out, raised, written)
    return written


def _raised_tensor(name: str, rung: Rung, reader: TensorReader, config: dict):
    """(GGUF tensor name, its bytes, raw ggml type, weight error) of linear `name` on `rung`."""
    from gguf import GGMLQuantizationType

    if ".experts." in name:
        raise OptkitError(f"{name}: llama.cpp stacks the experts into one tensor: repair raises dense linears")
    family = family_for(config.get("model_type"))
    runtime = family.runtime_name(f"{name}.weight")
    tensor_name = gguf_name(runtime, meta.gguf_architecture(config))
    weight = base_linear_weight(reader, name)  # a tied head: the embedding
    if rung.full:
        data, raw_type = tensor_bytes(weight, FULL_TYPES.get(weight.dtype, "F32"))
        data, error = torch.from_numpy(np.ascontiguousarray(data)), {"rel_error": 0.0, "mse": 0.0}
    else:
        scheme = rung.scheme(WeightScheme())  # a GGUF rung's scheme is its type's own
        qw = rtn_quantize(weight.float(), scheme, scheme.scale_dtype_for(weight.dtype))
        data = gguf_format.compress(name, qw)[f"{name}.{gguf_format.MARKER}"]
        raw_type, error = GGMLQuantizationType[rung.gguf_type], weight_error(weight, qw.dequantize())
    heads = meta.qk_heads(meta.language_model_config(config), runtime)
    if heads is not None:  # Llama's q/k rows in GGML's RoPE order, as the writer puts them (rows move whole)
        data = meta.permute_qk(data, heads)
    return tensor_name, data.numpy(), raw_type, error


def _copy_with(source: Path, out: Path, raised: dict[str, tuple[np.ndarray, object]], manifest: dict) -> None:
    """`source`'s metadata and tensors into `out`, the tensors of `raised` replaced and the manifest
    key rewritten (gguf-py's gguf_new_metadata.copy_with_new_metadata, with tensors swapped)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    names = {tensor.name for tensor in reader.tensors}
    if set(raised) - names:
        raise OptkitError(f"{source} has no tensor {sorted(set(raised) - names)[0]}: re-create the file")
    with atomic_output_file(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            for field in reader.fields.values():
                if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                    continue  # the writer's own
                value = dumps(manifest) if field.name == MANIFEST_KEY else field.contents()
                kind = field.types[0]
                sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(field.name, value, kind, sub_type=sub_type)
            tensors = [(t.name, *raised.get(t.name, (t.data, t.tensor_type))) for t in reader.tensors]
            for name, data, raw_type in tensors:
                writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw_type)
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for _, data, _ in tensors:
                writer.write_tensor_data(np.ascontiguousarray(data))
        finally:
            writer.close()
