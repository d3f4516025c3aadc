"""What vLLM's loaders read from a checkpoint, written down so artifacts can be checked without a GPU.

Read from vLLM's source (main branch as stored in the public code index, late 2026; re-read it for
the release you deploy):
- compressed-tensors, weight-only: vllm/model_executor/layers/quantization/compressed_tensors/
  schemes/compressed_tensors_wNa16.py, `CompressedTensorsWNA16.__init__` and `create_weights`:
  bits 2..8 symmetric (WNA16_SUPPORTED_TYPES_MAP), zero points only for 4 and 8 bits
  (WNA16_ZP_SUPPORTED_TYPES_MAP); strategy "group" with group_size or "channel";
  weight_packed int32 [out, ceil(in·bits/32)], weight_scale [out, in/group] (params dtype),
  weight_shape int64 [2], weight_zero_point int32 [ceil(out·bits/32), in/group] when asymmetric,
  weight_g_idx int32 [in] only with actorder "group".
- compressed-tensors W8A8: schemes/compressed_tensors_w8a8_int8.py, `CompressedTensorsW8A8Int8.
  create_weights`: weight int8 [out, in], weight_scale [out, 1] (channel), input_scale [1] for
  static per-tensor activations, none for dynamic per-token ones; symmetric activations only here.
- GPTQ: gptq_marlin.py `GPTQMarlinConfig` (TYPE_MAP: (4, sym), (8, sym); keys bits, group_size,
  desc_act, sym, lm_head) and `GPTQMarlinLinearMethod.create_weights`; other bit widths fall back
  to gptq.py `GPTQConfig` (bits 2, 3, 4, 8). qweight int32 [in·bits/32, out], g_idx int32 [in],
  qzeros int32 [groups, out·bits/32], scales float16 [groups, out].
- AWQ: awq_marlin.py `AWQMarlinConfig` (bits 4 with zero_point, keys bits, group_size,
  zero_point, modules_to_not_convert) and `AWQMarlinLinearMethod.create_weights`: qweight int32
  [in, out/8], qzeros int32 [groups, out/8], scales float16 [groups, out].
"""

import math

import torch

from optkit.compat.matrix import ArtifactKind, kind_from_quant_config, vllm_path

Spec = dict[str, tuple[torch.dtype | None, tuple[int, ...]]]  # suffix -> (dtype or None: any float, shape)


def _wna16(out: int, inp: int, bits: int, groups: int, symmetric: bool) -> Spec:
    spec = {
        "weight_packed": (torch.int32, (out, math.ceil(inp * bits / 32))),
        "weight_scale": (None, (out, groups)),
        "weight_shape": (torch.int64, (2,)),
    }
    if not symmetric:
        spec["weight_zero_point"] = (torch.int32, (math.ceil(out * bits / 32), groups))
    return spec


def _gptq(out: int, inp: int, bits: int, groups: int) -> Spec:
    return {
        "qweight": (torch.int32, (inp * bits // 32, out)),
        "qzeros": (torch.int32, (groups, out * bits // 32)),
        "scales": (torch.float16, (groups, out)),
        "g_idx": (torch.int32, (inp,)),
    }


def _awq(out: int, inp: int, groups: int) -> Spec:
    return {
        "qweight": (torch.int32, (inp, out // 8)),
        "qzeros": (torch.int32, (groups, out // 8)),
        "scales": (torch.float16, (groups, out)),
    }


def _w8a8(out: int, inp: int, static: bool) -> Spec:
    spec = {"weight": (torch.int8, (out, inp)), "weight_scale": (None, (out, 1))}
    if static:
        spec["input_scale"] = (None, (1,))
    return spec


REQUIRED_KEYS = {
    "compressed-tensors": ("config_groups", "format", "quantization_status"),
    "gptq": ("bits", "group_size", "desc_act", "sym"),
    "awq": ("bits", "group_size", "zero_point"),
}


def layer_spec(kind: ArtifactKind, quant_config: dict, out: int, inp: int) -> Spec:
    """The tensors vLLM creates for one quantized linear [out, in] of an artifact of `kind`."""
    if kind.format == "compressed-tensors":
        group = next(iter(quant_config["config_groups"].values()))
        if kind.w8a8:
            return _w8a8(out, inp, static=not (group.get("input_activations") or {}).get("dynamic", True))
        group_size = group["weights"].get("group_size") or inp
        return _wna16(out, inp, kind.bits, inp // group_size, kind.symmetric)
    group_size = quant_config["group_size"] if quant_config["group_size"] != -1 else inp
    if kind.format == "gptq":
        return _gptq(out, inp, kind.bits, inp // group_size)
    return _awq(out, inp, inp // group_size)


def check_vllm_spec(config: dict, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Problems that would stop vLLM loading: config keys, tensor names, shapes, dtypes.

    config: config.json; tensors: the checkpoint; shapes: layer name -> (out, in) of every
    quantized linear (from the model's config). An empty list means "loads by spec"."""
    quant_config = config["quantization_config"]
    kind = kind_from_quant_config(quant_config)
    path = vllm_path(kind)
    if path is None:
        return [f"vLLM has no loader for {kind.describe()} (see optkit/compat/vllm_spec.py)"]
    problems = [f"quantization_config lacks {key!r}" for key in REQUIRED_KEYS[kind.format] if key not in quant_config]
    if kind.format == "compressed-tensors" and not kind.w8a8:
        strategy = next(iter(quant_config["config_groups"].values()))["weights"].get("strategy")
        if strategy not in ("group", "channel"):
            problems.append(f"WNA16 reads strategy group or channel, not {strategy!r}")
    for name, (out, inp) in shapes.items():
        for suffix, (dtype, shape) in layer_spec(kind, quant_config, out, inp).items():
            tensor = tensors.get(f"{name}.{suffix}")
            if tensor is None:
                problems.append(f"{path}: {name}.{suffix} missing")
            elif tuple(tensor.shape) != shape:
                problems.append(f"{path}: {name}.{suffix} has shape {tuple(tensor.shape)}, vLLM creates {shape}")
            elif dtype is not None and tensor.dtype != dtype or dtype is None and not tensor.is_floating_point():
                problems.append(f"{path}: {name}.{suffix} is {tensor.dtype}, vLLM reads {dtype or 'a float'}")
    return problems
