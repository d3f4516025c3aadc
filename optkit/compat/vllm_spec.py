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
- compressed-tensors FP8 W8A8: schemes/compressed_tensors_w8a8_fp8.py, `CompressedTensorsW8A8Fp8.
  create_weights`: weight float8_e4m3fn [out, in], weight_scale [out, 1] (ChannelQuantScaleParameter),
  input_scale [1] (PerTensorScaleParameter) for static activations only.
- bitsandbytes 4-bit, pre-quantized: model_loader/bitsandbytes_loader.py reads `weight` (uint8, the
  packed nibbles, [out·in/2, 1]) with its `weight.absmax`, `weight.quant_map`,
  `weight.quant_state.bitsandbytes__nf4` (and `nested_*` with double quantization) and config keys
  quant_method "bitsandbytes", load_in_4bit, bnb_4bit_quant_type.
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

from optkit.compat.matrix import kind_from_quant_config, vllm_path
from optkit.families import family_for
from optkit.quant.formats.kind import ArtifactKind

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


def _w8a8(out: int, inp: int, static: bool, fp8: bool = False) -> Spec:
    spec = {"weight": (torch.float8_e4m3fn if fp8 else torch.int8, (out, inp)), "weight_scale": (None, (out, 1))}
    if static:
        spec["input_scale"] = (None, (1,))
    return spec


def _bnb_nf4(out: int, inp: int, double_quant: bool, blocksize: int = 64) -> Spec:
    spec: Spec = {
        "weight": (torch.uint8, (out * inp // 2, 1)),
        "weight.absmax": (torch.uint8 if double_quant else torch.float32, (out * inp // blocksize,)),
        "weight.quant_map": (torch.float32, (16,)),
        "weight.quant_state.bitsandbytes__nf4": (torch.uint8, ()),  # () here: any length
    }
    if double_quant:
        spec["weight.nested_absmax"] = (torch.float32, ())
        spec["weight.nested_quant_map"] = (torch.float32, (256,))
    return spec


REQUIRED_KEYS = {
    "compressed-tensors": ("config_groups", "format", "quantization_status"),
    "gptq": ("bits", "group_size", "desc_act", "sym"),
    "awq": ("bits", "group_size", "zero_point"),
    "bitsandbytes": ("load_in_4bit", "bnb_4bit_quant_type"),
}


def layer_spec(kind: ArtifactKind, quant_config: dict, out: int, inp: int) -> Spec:
    """The tensors vLLM creates for one quantized linear [out, in] of an artifact of `kind`."""
    if kind.format == "compressed-tensors":
        group = next(iter(quant_config["config_groups"].values()))
        if kind.w8a8:
            static = not (group.get("input_activations") or {}).get("dynamic", True)
            return _w8a8(out, inp, static, fp8=kind.type == "float")
        group_size = group["weights"].get("group_size") or inp
        return _wna16(out, inp, kind.bits, inp // group_size, kind.symmetric)
    if kind.format == "bitsandbytes":
        return _bnb_nf4(out, inp, double_quant=bool(quant_config.get("bnb_4bit_use_double_quant")))
    group_size = quant_config["group_size"] if quant_config["group_size"] != -1 else inp
    if kind.format == "gptq":
        return _gptq(out, inp, kind.bits, inp // group_size)
    return _awq(out, inp, inp // group_size)


# Mixture-of-experts checkpoints: vLLM's models/mixtral.py, qwen2_moe.py and qwen3_moe.py `load_weights`
# read each expert's linears through FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name,
# ckpt_down_proj_name, ckpt_up_proj_name) as `{block}.experts.{N}.{name}.<tensor>` under the
# checkpoint's names (the family's MoE layout and checkpoint renames: Mixtral's block_sparse_moe),
# each with the tensors of a dense linear of its method (the spec above); the router `{block}.gate`
# is unquantized (ReplicatedLinear with quant_config=None), as is Qwen2-MoE's shared_expert_gate.
def moe_problems(config: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Experts missing under the names vLLM reads, or a quantized router."""
    model_type = config.get("model_type")
    family = family_for(model_type)
    layout = family.moe
    if layout is None or model_type not in family.model_types:
        return []
    problems = []
    for index in range(config["num_hidden_layers"]):
        router = family.checkpoint_name(f"model.layers.{index}.{layout.router_name}")
        prefix = router.removesuffix(f".{layout.router}")
        weight = tensors.get(f"{router}.weight")
        if weight is None:  # a dense layer (Qwen's mlp_only_layers)
            continue
        if not weight.is_floating_point() or f"{router}.weight_scale" in tensors:
            problems.append(f"{router} is quantized: vLLM reads the router in full precision")
        present = {key.rsplit(".", 1)[0] for key in tensors if key.startswith(f"{prefix}.experts.")}
        for expert in range(layout.num_experts(config)):
            for name in layout.expert_linears:
                if f"{prefix}.experts.{expert}.{name}" not in present:
                    problems.append(f"{prefix}.experts.{expert}.{name} missing: vLLM reads each expert by that name")
    return problems


def architecture_problems(config: dict) -> list[str]:
    """vLLM picks its model class by config.json's `architectures`: the one the model's family names."""
    model_type = config.get("model_type")
    if model_type is None:  # a bare quantization_config: the layer specs alone
        return []
    vllm = family_for(model_type).model_type(model_type).vllm
    if vllm is None:
        return [f"vLLM has no model for model_type {model_type!r}: its family names none"]
    named = config.get("architectures") or []
    if vllm not in named:
        return [f"config.json's architectures {named} lack {vllm}, the class vLLM runs {model_type} with"]
    return []


def check_vllm_spec(config: dict, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Problems that would stop vLLM loading: config keys, tensor names, shapes, dtypes.

    config: config.json; tensors: the checkpoint; shapes: layer name -> (out, in) of every
    quantized linear (from the model's config). An empty list means "loads by spec"."""
    quant_config = config["quantization_config"]
    kind = kind_from_quant_config(quant_config)
    path = vllm_path(kind)
    if path is None:
        return [f"vLLM has no loader for {kind.describe()}: not loadable by vLLM (see optkit/compat/vllm_spec.py)"]
    if kind.format not in REQUIRED_KEYS:  # a plug-in format that names a vLLM loader whose layout is not written here
        return [f"{path}: optkit/compat/vllm_spec.py has no spec of what vLLM reads for {kind.format}: not checked"]
    problems = [f"quantization_config lacks {key!r}" for key in REQUIRED_KEYS[kind.format] if key not in quant_config]
    problems += architecture_problems(config) + moe_problems(config, tensors)
    if kind.format == "compressed-tensors" and not kind.w8a8:
        strategy = next(iter(quant_config["config_groups"].values()))["weights"].get("strategy")
        if strategy not in ("group", "channel"):
            problems.append(f"WNA16 reads strategy group or channel, not {strategy!r}")
    for name, (out, inp) in shapes.items():
        for suffix, (dtype, shape) in layer_spec(kind, quant_config, out, inp).items():
            tensor = tensors.get(f"{name}.{suffix}")
            if tensor is None:
                problems.append(f"{path}: {name}.{suffix} missing")
            elif shape != () and tuple(tensor.shape) != shape:  # () : any length
                problems.append(f"{path}: {name}.{suffix} has shape {tuple(tensor.shape)}, vLLM creates {shape}")
            elif dtype is not None and tensor.dtype != dtype or dtype is None and not tensor.is_floating_point():
                problems.append(f"{path}: {name}.{suffix} is {tensor.dtype}, vLLM reads {dtype or 'a float'}")
    return problems
