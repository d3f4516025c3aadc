"""The AutoAWQ "GEMM" checkpoint layout (`quant_method: awq`, `version: gemm`), as vLLM reads it.

Per quantized linear `P` with W [out, in], 4 bits, G = in / group_size groups:
  P.qweight  int32 [in, out / 8]   unsigned q = q_signed + 8, eight output columns per int32,
                                   interleaved: nibble i holds column 8c + AWQ_ORDER[i]
  P.qzeros   int32 [G, out / 8]    unsigned zero points, packed the same way
  P.scales   float16 [G, out]
Dequantization: Ŵᵀ[i, o] = (q[i, o] − z[i // group_size, o]) · scales[i // group_size, o].
No g_idx: GPTQ act-order cannot be stored (static groups can).
"""

import torch

from optkit.errors import OptkitError
from optkit.quant.formats.common import dequantize_layers, weight_only
from optkit.quant.formats.defaults import check_model as check_model
from optkit.quant.formats.defaults import constrain as constrain
from optkit.quant.formats.defaults import file_config as file_config
from optkit.quant.formats.defaults import gptq_defaults as gptq_defaults
from optkit.quant.formats.defaults import is_w8a8 as is_w8a8
from optkit.quant.formats.defaults import quant_method_is
from optkit.quant.formats.defaults import w8a8_modules as w8a8_modules
from optkit.quant.formats.defaults import write_file as write_file
from optkit.quant.formats.kind import ArtifactKind
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme

NAME = "awq"
detect = quant_method_is(NAME)
# CheckpointFormat's defaults, imported above (formats/defaults.py):
# check_model, constrain, file_config, gptq_defaults, is_w8a8, w8a8_modules, write_file
SUFFIXES = ("qweight", "qzeros", "scales")
MARKER = "qweight"  # the suffix that marks a quantized linear
SUFFIX = None  # an artifact directory
runtime = None  # optkit's runtime
LOADERS = {"optkit": (), "gptqmodel": ()}  # and vLLM (`vllm_loader`)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column held by nibble i of each int32
OFFSET = 8  # signed 4-bit q in [-8, 7] <-> unsigned [0, 15]


def check(
    scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]], activations: str | None = None
) -> None:
    weight_only(NAME, activations)
    if scheme.bits != 4:
        raise OptkitError(f"--format awq stores 4-bit weights, not {scheme.bits}: use --format compressed-tensors")
    if scheme.group_size == -1:
        raise OptkitError("--format awq needs a group size: give --group-size (e.g. 128)")
    if act_order == "group":
        raise OptkitError("--format awq cannot store act-order (no g_idx): add --static-groups or use --format gptq")
    for name, _, out_features in layers:
        if out_features % 8:
            raise OptkitError(
                f"{name} has {out_features} outputs, not a multiple of 8: use --format compressed-tensors"
            )


def quantization_config(
    scheme: WeightScheme, act_order: bool | str, ignore: list[str], activations: str | None = None
) -> dict:
    return {
        "quant_method": NAME,
        "version": "gemm",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "zero_point": True,  # symmetric weights are stored with zero point 8
        "modules_to_not_convert": ignore,
    }


def _pack_columns(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit ints [R, C] -> int32 [R, C / 8] in AWQ's interleaved order."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    shifts = torch.arange(8, dtype=torch.int64) * 4
    packed = (grouped << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `_pack_columns`: int32 [R, C / 8] -> int64 [R, C]."""
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # nibble i = column AWQ_ORDER[i]
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def compress(prefix: str, qw: QuantizedWeight, activations: str | None = None) -> dict[str, torch.Tensor]:
    assert qw.g_idx is None, "AWQ cannot store g_idx (checked in `check`)"
    scales = qw.scale.to(torch.float16)
    if not torch.equal(scales.to(qw.scale.dtype), qw.scale):
        raise OptkitError(f"{prefix}: scales do not fit float16 exactly: use --format compressed-tensors")
    return {
        f"{prefix}.qweight": _pack_columns((qw.q.to(torch.int64) + OFFSET).T),
        f"{prefix}.qzeros": _pack_columns((qw.zero_point.to(torch.int64) + OFFSET).T),
        f"{prefix}.scales": scales.T.contiguous(),
    }


def decompress(prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    q = (_unpack_columns(tensors[f"{prefix}.qweight"]) - OFFSET).T.to(torch.int8).contiguous()
    zeros = (_unpack_columns(tensors[f"{prefix}.qzeros"]) - OFFSET).T.to(torch.int8).contiguous()
    return QuantizedWeight(q, tensors[f"{prefix}.scales"].T.contiguous(), zeros, scheme)


def scheme_from_config(quant_config: dict) -> WeightScheme:
    # zero points are always stored; the integers read back are exact either way
    return WeightScheme(bits=quant_config["bits"], group_size=quant_config["group_size"], symmetric=False)


def artifact_kind(quant_config: dict) -> ArtifactKind:
    return ArtifactKind(NAME, quant_config["bits"], False)  # zero points always stored


def vllm_loader(kind: ArtifactKind) -> str | None:
    return "AWQ-Marlin" if kind.bits == 4 else None


def dequantized_state_dict(
    tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    scheme = scheme_from_config(quant_config)
    return dequantize_layers(tensors, "qweight", SUFFIXES, lambda prefix: decompress(prefix, tensors, scheme), dtype)
