"""GGUF, llama.cpp's single-file format: `--format gguf` writes one `.gguf`.

The weights are ggml's legacy block types (weights/gguf_blocks.py), chosen by the scheme:
  symmetric 4-bit g32 -> Q4_0    asymmetric 4-bit g32 -> Q4_1    symmetric 8-bit g32 -> Q8_0
  (and 5-bit g32 -> Q5_0, Q5_1: only a K mix's fallback for rows 256 does not divide gives one)
or a K-quant (Q2_K .. Q6_K, weights/kquants) when the scheme names one (`constrain(scheme, "Q4_K")`,
weights/stored.k_scheme): 256-column super-blocks whose grids the methods fit and round onto.
`constrain` hands the methods a StoredScheme (fp16 scales; Q4_1's fp16 minimum m as a float zero
point), so RTN, GPTQ and AWQ round onto exactly what the blocks hold. Tensors optkit leaves in full
precision (embeddings, lm_head, ignored layers) keep their dtype (BF16/F16/F32), 1-D ones are F32, as
llama.cpp's converter writes them; the metadata is the converter's (quant/formats/gguf_metadata.py).

The quantizer stages an artifact directory whose quantized linears are `P.gguf_blocks` (uint8 rows of
blocks, the Protocol's compress/decompress), then `write_file` turns it into the .gguf, written to a
temporary name and renamed into place. llama.cpp runs the file (`runtime`); `read_file` gives it back
as a Hugging Face config and a dequantized state dict for optkit's own runtime and the tests.
"""

from pathlib import Path

import numpy as np
import torch

from optkit.artifacts import atomic_output_file
from optkit.errors import OptkitError
from optkit.json_strict import dumps
from optkit.quant.formats import gguf_metadata as meta
from optkit.quant.formats import gguf_mix, gguf_plan, gguf_types
from optkit.quant.formats.common import dequantize_layers, weight_only
from optkit.quant.formats.defaults import is_w8a8 as is_w8a8
from optkit.quant.formats.defaults import quant_method_is
from optkit.quant.formats.defaults import vllm_loader as vllm_loader
from optkit.quant.formats.defaults import w8a8_modules as w8a8_modules
from optkit.quant.formats.gguf_vocab import add_tokenizer, check_tokenizer
from optkit.quant.formats.kind import ArtifactKind
from optkit.weights import gguf_blocks, kquants
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme
from optkit.weights.stored import StoredScheme, k_scheme, k_type

NAME = "gguf"
detect = quant_method_is(NAME)
# CheckpointFormat's defaults, imported above (formats/defaults.py): is_w8a8, vllm_loader, w8a8_modules
MARKER = "gguf_blocks"
SUFFIXES = ("gguf_blocks",)
SUFFIX = ".gguf"  # what `optkit eval` and the runtime recognise as a GGUF file
runtime = "llama.cpp"
LOADERS = {"llama.cpp": ()}  # llama.cpp reads GGUF, and no other loader of the matrix does
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
# a file of one K type is labelled as llama-quantize labels its --pure file of that type
FILE_TYPES |= {"Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18}


def block_type(scheme: WeightScheme) -> str:
    if k_type(scheme) is not None:
        return k_type(scheme)
    if scheme.group_size != gguf_blocks.BLOCK or getattr(scheme, "type", "int") != "int":
        raise OptkitError(
            f"--format gguf stores integer blocks of {gguf_blocks.BLOCK} columns (Q4_0, Q4_1, Q8_0): "
            f"use --group-size {gguf_blocks.BLOCK} with --bits 4 or 8, or for a K-quant mix such as Q4_K_M "
            "--gguf-type Q4_K_M (and no --group-size)"
        )
    if scheme.bits == 4:
        return "Q4_0" if scheme.symmetric else "Q4_1"
    if scheme.bits == 5:  # a StoredScheme of gguf_mix.block_scheme: no recipe sets 5 bits
        return "Q5_0" if scheme.symmetric else "Q5_1"
    if scheme.bits == 8 and scheme.symmetric:
        return "Q8_0"
    if scheme.bits == 8:
        raise OptkitError("--format gguf: 8-bit blocks (Q8_0) are symmetric: use --sym")
    raise OptkitError(f"--format gguf has no {scheme.bits}-bit block type optkit writes: use --bits 4 or 8")


def check(
    scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]], activations: str | None = None
) -> None:
    weight_only(NAME, activations)
    block_type(scheme)
    if act_order == "group":
        raise OptkitError("--format gguf keeps each block's 32 columns together: with --act-order add --static-groups")
    # a K mix gives a row its super-blocks of 256 divide no other type (gguf_mix.fallback): blocks of 32 still
    fallback = f" (or its fallback {gguf_mix.FALLBACK[k_type(scheme)]}'s)" if k_type(scheme) is not None else ""
    for name, in_features, out_features in layers:
        if in_features % gguf_blocks.BLOCK:
            raise OptkitError(
                f"{name} ({out_features}×{in_features}): {block_type(scheme)} blocks{fallback} need input widths "
                f"divisible by {gguf_blocks.BLOCK}: use --format compressed-tensors"
            )


def check_model(config: dict, model_dir: Path) -> None:
    """Before any calibration: what the file could not hold (architecture, RoPE, tokenizer)."""
    meta.architecture(config)  # the family's llama.cpp architecture, and what its graph runs
    meta.rope_type(config)
    check_tokenizer(model_dir, config)


def constrain(scheme: WeightScheme, gguf_type: str | None = None) -> StoredScheme:
    """The scheme the methods quantize onto: fp16 scales, and Q4_1's fp16 minimum as a float zero point;
    with `gguf_type` a K-quant (Q4_K, ...), that type's super-block grid instead (the caller picks it)."""
    if gguf_type in kquants.K_TYPES:
        return k_scheme(gguf_type)
    if k_type(scheme) is not None:
        return scheme
    block_type(scheme)
    return StoredScheme(**scheme.model_dump(), float_zero=not scheme.symmetric)


def linear_schemes(options, config: dict, model_dir: Path, targets: list[str]) -> dict[str, StoredScheme]:
    """The target linears (checkpoint names) a K mix (`--gguf-type Q4_K_M`) gives another type than its
    default, each on that type's grid (gguf_mix: attn_v and ffn_down of the use_more_bits layers in
    Q6_K, ...); {} for every other file type. The methods quantize each onto its own scheme."""
    if options.gguf is None or options.gguf.full_precision:
        return {}
    from optkit.modeldir import weight_files
    from optkit.safetensors_stream import lazy_tensors_in

    shapes = {key: t.shape for file in weight_files(model_dir) for key, t in lazy_tensors_in(file).items()}
    plan = gguf_plan.plan(list(shapes), config, MARKER)
    types = gguf_types.linear_types(options.gguf.type, plan, config, shapes.__getitem__)
    default = block_type(options.weights)
    raised = {name: types[name] for name in targets if types[name] != default}
    for name, qtype in raised.items():
        if qtype not in (*kquants.K_TYPES, *gguf_mix.BLOCK_SCHEMES):
            raise OptkitError(f"{name}: GGUF {options.gguf.type} stores it as {qtype}, which optkit does not write")
    return {name: gguf_mix.block_scheme(qtype) for name, qtype in raised.items()}


def gptq_defaults(scheme: WeightScheme) -> dict:
    """GPTQ's settings for a scheme when the recipe leaves them unset. Q4_0: act-order with static
    groups and llama.cpp's own scale rule (d = signed max / −8, rtn.signed_max_qparams). Chosen on
    `small` on data neither calibration nor the gate reads (held-out-split files outside `heldout`,
    calib windows calibration skipped), where they lowered both perplexity and KLD against the
    plain settings (docs/results.md, GGUF); not measured for Q4_1 and Q8_0, which keep the plain ones."""
    q4_0 = (scheme.bits, scheme.group_size, scheme.symmetric, scheme.type) == (4, gguf_blocks.BLOCK, True, "int")
    return {"act_order": True, "static_groups": True, "scale": "signed_max"} if q4_0 else {}


def quantization_config(
    scheme: WeightScheme, act_order: bool | str, ignore: list[str], activations: str | None = None
) -> dict:
    return {"quant_method": NAME, "type": block_type(scheme), "bits": scheme.bits, "group_size": scheme.group_size,
            "sym": scheme.symmetric, "modules_to_not_convert": ignore}  # fmt: skip


def compress(prefix: str, qw: QuantizedWeight, activations: str | None = None) -> dict[str, torch.Tensor]:
    if qw.g_idx is not None:
        raise OptkitError(f"{prefix}: GGUF blocks keep columns in order: use --static-groups with --act-order")
    qtype = block_type(qw.scheme)
    if qtype in kquants.K_TYPES:
        if qw.grid is None:
            raise OptkitError(f"{prefix}: {qtype} stores super-block grids: quantize with --format gguf from the start")
        return {f"{prefix}.{MARKER}": kquants.pack(qtype, kquants.levels(qw), qw.grid)}
    minimum = qtype in gguf_blocks.WITH_MINIMUM
    if qw.scale.dtype != torch.float16 or (minimum and qw.zero_point.dtype != torch.float16):
        raise OptkitError(f"{prefix}: GGUF blocks store fp16 scales: quantize with --format gguf from the start")
    return {f"{prefix}.{MARKER}": gguf_blocks.pack(qtype, qw.q, qw.scale, qw.zero_point if minimum else None)}


def scheme_from_config(quant_config: dict) -> StoredScheme:
    if quant_config.get("type") in kquants.K_TYPES:
        return k_scheme(quant_config["type"])
    return StoredScheme(
        bits=quant_config["bits"],
        group_size=quant_config["group_size"],
        symmetric=quant_config["sym"],
        float_zero=not quant_config["sym"],
    )


def artifact_kind(quant_config: dict) -> ArtifactKind:
    bits, symmetric = quant_config["bits"], quant_config["sym"]
    if quant_config.get("type") in kquants.K_TYPES:
        return ArtifactKind(NAME, bits, symmetric, label=quant_config["type"])
    return ArtifactKind(NAME, bits, symmetric, label="Q8_0" if bits == 8 else "Q4_0" if symmetric else "Q4_1")


def file_config(path: Path) -> dict:
    """The Hugging Face config a .gguf's metadata describes, once the file checks out (gguf_read.py)."""
    from optkit.quant.formats.gguf_read import read_config

    return read_config(path)


def decompress(prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    data = tensors[f"{prefix}.{MARKER}"]
    qtype = block_type(scheme)
    if qtype in kquants.K_TYPES:
        q_u, grid = kquants.unpack(qtype, data, data.shape[1] // kquants.block_bytes(qtype) * kquants.QK_K)
        return kquants.quantized_weight(q_u, grid, scheme)
    cols = data.shape[1] // gguf_blocks.BLOCK_BYTES[qtype] * gguf_blocks.BLOCK
    q, d, m = gguf_blocks.unpack(qtype, data, cols)
    zero = m if m is not None else torch.zeros(d.shape, dtype=torch.int8)
    return QuantizedWeight(q, d, zero, scheme)


def dequantized_state_dict(
    tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    scheme = scheme_from_config(quant_config)
    return dequantize_layers(tensors, MARKER, SUFFIXES, lambda prefix: decompress(prefix, tensors, scheme), dtype)


def _tensor_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, "object"]:
    """A full-precision tensor as llama.cpp's converter stores it: (array, raw GGML type)."""
    from gguf import GGMLQuantizationType as T

    if tensor.ndim == 1 or tensor.dtype == torch.float32:
        return tensor.float().numpy(), T.F32
    if tensor.dtype == torch.float16:
        return tensor.numpy(), T.F16
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.uint8).numpy(), T.BF16
    raise OptkitError(f"--format gguf: cannot store a {tensor.dtype} tensor")


def write_file(staged: Path, out: Path, manifest: dict) -> None:
    """The .gguf for a staged artifact directory: written as a new `.NAME.tmp-*`, renamed to `out`."""
    import gguf

    from optkit.modeldir import TensorReader, read_config

    config = read_config(staged)
    arch = meta.architecture(config)
    quant_config = config["quantization_config"]
    qtype = quant_config["type"]
    reader = TensorReader(staged)
    with atomic_output_file(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            writer.add_type(gguf.GGUFType.MODEL)
            writer.add_name(Path(manifest["base_model"]["path"]).name)
            writer.add_quantized_by("optkit")
            writer.add_file_type(gguf_types.file_type_id(manifest, FILE_TYPES[qtype]))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            meta.add_hyperparameters(writer, config)
            add_tokenizer(writer, staged, config)
            plan = gguf_plan.plan(list(reader.keys()), config, MARKER)  # in file order
            types = gguf_types.planned_types(plan, manifest, config, lambda key: reader.get(key).shape)
            manifest = gguf_types.with_layer_types(manifest, plan, types)
            writer.add_string("optkit.manifest", dumps({k: v for k, v in manifest.items() if k != "files"}))

            def array(entry: gguf_plan.PlannedTensor) -> tuple[np.ndarray, object]:
                tensor = gguf_plan.tensor(reader.get, entry, config)
                if entry.quantized:  # the blocks of the type the mix gives it (planned_types checked their size)
                    return tensor.numpy(), gguf.GGMLQuantizationType[types.get(entry.name, qtype)]
                if types.get(entry.name) is not None:  # the file type's, for a tensor the methods left as it was
                    return gguf_types.tensor_bytes(tensor, types[entry.name])
                return _tensor_bytes(tensor)

            extra = gguf_plan.extra_tensors(config)  # generate_extra_tensors: rope_freqs, LongRoPE's factors
            for name, values in extra.items():
                writer.add_tensor_info(name, values.shape, values.dtype, values.nbytes)
            for entry in plan:  # shapes and sizes first: one tensor in memory at a time below
                data, data_raw = array(entry)
                writer.add_tensor_info(entry.name, data.shape, data.dtype, data.nbytes, raw_dtype=data_raw)
                del data
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for values in extra.values():
                writer.write_tensor_data(values)
            for entry in plan:
                writer.write_tensor_data(np.ascontiguousarray(array(entry)[0]))
        finally:
            writer.close()
