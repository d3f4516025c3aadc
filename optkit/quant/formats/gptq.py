"""The GPTQ v1 checkpoint layout (AutoGPTQ / gptqmodel / vLLM `quant_method: gptq`).

Per quantized linear `P` with W [out, in], b bits, p = 32 / b values per int32, G groups:
  P.qweight  int32 [in / p, out]   unsigned q = q_signed + 2^(b-1), packed along `in`:
                                   value of input row r·p + j sits at bits j·b of qweight[r]
  P.qzeros   int32 [G, out / p]    unsigned zero point minus one (the v1 convention), packed along `out`
  P.scales   float16 [G, out]
  P.g_idx    int32 [in]            group of each input row (act-order makes it non-contiguous)
Dequantization: Ŵᵀ[i, o] = (q[i, o] − (qzeros[g_idx[i], o] + 1)) · scales[g_idx[i], o].
The v1 zero-point offset cannot store an unsigned zero of 0, so this writer is symmetric-only
(zero point 2^(b-1)), which is also what vLLM's Marlin GPTQ kernels require.
"""

import torch

from optkit.errors import OptkitError
from optkit.quant.rtn import QuantizedWeight
from optkit.quant.schemes import WeightScheme

NAME = "gptq"
PACKABLE_BITS = (2, 4, 8)
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def check(scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]]) -> None:
    """User errors for what this layout cannot store. layers: (name, in_features, out_features)."""
    if scheme.bits not in PACKABLE_BITS:
        raise OptkitError(
            f"--format gptq stores {', '.join(map(str, PACKABLE_BITS))} bits, not {scheme.bits}: "
            "use --format compressed-tensors"
        )
    if not scheme.symmetric:
        raise OptkitError(
            "--format gptq stores symmetric weights only (its v1 zero points cannot hold 0): "
            "use --sym or --format compressed-tensors"
        )
    per_int = 32 // scheme.bits
    for name, in_features, out_features in layers:
        if in_features % per_int or out_features % per_int:
            raise OptkitError(
                f"{name} ({out_features}×{in_features}) cannot be packed {per_int} per int32: "
                "use --format compressed-tensors"
            )


def quantization_config(scheme: WeightScheme, act_order: bool | str, ignore: list[str]) -> dict:
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


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ints [R, C] -> int32 [R / p, C]: row r·p + j at bits j·b (two's complement wrap)."""
    per_int = 32 // bits
    grouped = values.to(torch.int64).reshape(-1, per_int, values.shape[1])
    shifts = (torch.arange(per_int, dtype=torch.int64) * bits).view(1, per_int, 1)
    packed = (grouped << shifts).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_rows`: int32 [R / p, C] -> int64 [R, C]."""
    per_int = 32 // bits
    shifts = (torch.arange(per_int, dtype=torch.int64) * bits).view(1, per_int, 1)
    values = (packed.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def compress(prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
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
        f"{prefix}.qzeros": _pack_rows((qw.zero_point.to(torch.int64) + offset - 1).T, bits).T.contiguous(),
        f"{prefix}.scales": scales.T.contiguous(),
        f"{prefix}.g_idx": g_idx.to(torch.int32),
    }


def decompress(prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    bits = scheme.bits
    offset = 1 << (bits - 1)
    q = (_unpack_rows(tensors[f"{prefix}.qweight"], bits) - offset).T.to(torch.int8)
    zeros = _unpack_rows(tensors[f"{prefix}.qzeros"].T.contiguous(), bits).T + 1 - offset
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


def dequantized_state_dict(
    tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    scheme = scheme_from_config(quant_config)
    prefixes = [k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")]
    state = {k: v for k, v in tensors.items() if not k.endswith(SUFFIXES)}
    for prefix in prefixes:
        qw = decompress(prefix, tensors, scheme)
        state[f"{prefix}.weight"] = qw.dequantize(dtype)
    return state
