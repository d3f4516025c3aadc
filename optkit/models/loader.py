"""Load a model directory (plain checkpoint or optkit artifact) into the runtime's `CausalLM`.

The model is built on the meta device, then given the checkpoint's tensors (no random init, no
copy). Quantized layers stay quantized: integer weight-only ones as `PackedIntLinear` (packed integers,
run by the device's fastest kernel), W8A8 ones as `W8A8Linear` (int8 matmuls). Safetensors only.
"""

import importlib
import logging
from pathlib import Path

import torch
from torch import nn

from optkit.errors import OptkitError
from optkit.families import family_for
from optkit.json_strict import read_object
from optkit.kernels import cpu_bf16, cpu_fp32
from optkit.kernels.nf4 import NF4Linear
from optkit.kernels.packed_int import PackedIntLinear
from optkit.kernels.w8a8 import W8A8Linear
from optkit.modeldir import read_config, read_tensors, resolve_model_dir, verify_weights
from optkit.models.config import ModelConfig
from optkit.models.fusion import fuse_projections
from optkit.models.llama import CausalLM
from optkit.quant.formats.common import check_tensor_shapes, read_checked

# tensors a checkpoint may carry that the runtime recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
log = logging.getLogger(__name__)


def load_runtime_model(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    fuse: bool = True,
    prepare: bool = True,
    pack: bool = True,
) -> CausalLM:
    """A reference model name (`small`, `draft`) or a model directory, ready to run on `device`.
    `fuse`: q/k/v and gate/up as one matmul each where their layouts agree (models/fusion.py).
    `prepare`: repack quantized layers for this device's kernel now rather than at their first call
    (serving wants it at load; an evaluation of long windows never calls the decode kernel).
    `pack`: on the CPU, bf16 linears through oneDNN with packed weights (`pack_bf16_linears`), and with
    `prepare` fp32 ones where MKL's fp32 GEMM is slow at a decode step's rows (kernels/cpu_fp32.py; an
    evaluation of long windows keeps MKL, as fast or faster at their rows)."""
    path = resolve_model_dir(name_or_path)
    verify_weights(path)
    config_dict = read_config(path)
    config = ModelConfig.from_hf(config_dict, _generation_config(path))
    with torch.device("meta"):
        model = _runtime_class(config.model_type)(config)
    tensors = _runtime_view(read_tensors(path), config.model_type)
    quant_config = config_dict.get("quantization_config")
    consumed = _install_quantized(model, tensors, quant_config, dtype, path) if quant_config else set()
    state = {
        key: value.to(dtype) if value.is_floating_point() else value
        for key, value in tensors.items()
        if key not in consumed and not key.endswith(_IGNORED_SUFFIXES)
    }
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a copy of the embedding some checkpoints store anyway
    expected = model.state_dict()  # on the meta device: names and shapes, no memory
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise OptkitError(
            f"{path}: weights the {config.model_type} model has no place for: {', '.join(unexpected[:3])}: "
            "check config.json against the checkpoint"
        )
    check_tensor_shapes(state, expected, str(path))
    model.load_state_dict(state, strict=False, assign=True)
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise OptkitError(f"{path}: the checkpoint lacks {', '.join(missing[:3])}: re-create or re-download it")
    model = model.to(device).eval().requires_grad_(False)
    if fuse:
        fuse_projections(model)
    if pack and dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        pack_bf16_linears(model)
    if pack and prepare and dtype == torch.float32 and torch.device(device).type == "cpu":
        cpu_fp32.pack_linears(model)
    for module in model.modules() if prepare else ():  # quantized layers repack once for this device's kernel
        if hasattr(module, "prepare"):
            module.prepare()
    return model


def pack_bf16_linears(model: CausalLM) -> int:
    """bf16 on the CPU: every full-precision linear, and the output head, through oneDNN with its
    weight packed once, or where oneDNN has no bf16 path through optkit's AVX2 kernel
    (kernels/cpu_bf16.py: both faster than a plain bf16 GEMV at one row, which is no faster than
    fp32's; docs/results.md). A tied head gets a packed copy of the embedding (vocab x hidden bf16
    more memory; the lookup keeps the plain table) or, for the AVX2 kernel, the embedding itself. How
    many linears were swapped; none where this CPU has neither path."""
    packed = cpu_bf16.pack_linears(model)
    if packed and getattr(model, "lm_head", False) is None:
        model.lm_head = cpu_bf16.head_linear(model.get_input_embeddings().weight.detach())
        packed += 1
    return packed


def _runtime_view(tensors: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the runtime's names: its family's renames (Gemma 3's
    language_model.model.* -> model.*), without the parts the runtime leaves out (said in one line)."""
    family = family_for(model_type)
    if not family.runtime_renames and family.outside_runtime is None and not family.checkpoint_renames:
        return tensors
    prefixes, reason = family.outside_runtime or ((), "")
    left_out = sorted({p for key in tensors for p in prefixes if key.startswith(p)})
    if left_out:
        log.info("%s: leaves %s out of the runtime: %s", family.name, ", ".join(p + "*" for p in left_out), reason)
    return {name: tensor for key, tensor in tensors.items() if (name := family.runtime_name(key)) is not None}


def _runtime_class(model_type: str) -> type[CausalLM]:
    """The runtime model its family names (families/), e.g. optkit.models.llama:CausalLM."""
    module, _, name = family_for(model_type).runtime.partition(":")
    return getattr(importlib.import_module(module), name)


def _generation_config(path: Path) -> dict | None:
    file = path / "generation_config.json"
    if not file.exists():
        return None
    return read_object(file, "generation settings", "repair or delete it")


def _install_quantized(
    model: CausalLM, tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype, path: Path
) -> set[str]:
    """Swap each quantized linear of the checkpoint into `model`; returns the tensor keys used."""
    from optkit.quant.formats import reader_for
    from optkit.quant.formats.mixed import layer_schemes

    fmt = reader_for(quant_config, str(path))
    if fmt.is_w8a8(quant_config):  # int8 (or FP8) activations: compressed-tensors' W8A8
        try:
            modules = fmt.w8a8_modules(tensors, quant_config)
        except OptkitError as e:  # a layer whose tensors do not fit each other
            raise OptkitError(f"{path}: {e}") from e
        suffixes = ("weight", "weight_scale", "input_scale", "bias")
    else:
        marker = fmt.MARKER  # the tensor suffix that marks a weight-only quantized layer
        prefixes = [k.removesuffix(f".{marker}") for k in tensors if k.endswith(f".{marker}")]
        schemes = layer_schemes(fmt, quant_config, prefixes, str(path / "config.json"))  # one, or each layer's
        modules = {}
        for prefix in prefixes:
            bias = tensors.get(f"{prefix}.bias")
            try:
                qw = read_checked(prefix, lambda p: fmt.decompress(p, tensors, schemes[p]))  # errors name the layer
            except OptkitError as e:
                raise OptkitError(f"{path}: {e}") from e
            layer = NF4Linear if getattr(qw.scheme, "type", "int") == "nf4" else PackedIntLinear
            if prefix == "lm_head" and bias is None and _is_int8_per_channel(qw.scheme):
                modules[prefix] = W8A8Linear(qw.q, qw.scale.float().reshape(-1))  # the int8 head kernel
                continue
            try:
                modules[prefix] = layer.from_quantized(qw, None if bias is None else bias.to(dtype))
            except OptkitError as e:  # the bias does not fit
                raise OptkitError(f"{path}: {prefix}: {e}") from e
        suffixes = (*fmt.SUFFIXES, "bias")
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    strays = sorted(set(modules) - linears)
    if strays:
        raise OptkitError(
            f"{path}: quantized layers the {model.config.model_type} model does not have: {', '.join(strays[:3])}: "
            "check config.json against the checkpoint"
        )
    for name, module in modules.items():
        expected = model.get_submodule(name)
        if (module.in_features, module.out_features) != (expected.in_features, expected.out_features):
            raise OptkitError(
                f"{path}: {name} is {module.out_features}×{module.in_features} in the checkpoint but "
                f"{expected.out_features}×{expected.in_features} in config.json: re-create the artifact"
            )
        model.set_submodule(name, module)
    return {f"{name}.{suffix}" for name in modules for suffix in suffixes} & set(tensors)


def _is_int8_per_channel(scheme) -> bool:
    """An int8 head (quant/head.py's `--head int8`): symmetric 8-bit integers per output channel,
    which the W8A8 kernel multiplies with int8 activations per token (the large-vocabulary head's
    fastest path on the CPU; its logits stay float32)."""
    return getattr(scheme, "type", "int") == "int" and scheme.bits == 8 and scheme.symmetric and scheme.group_size == -1
