"""Any model directory as a transformers causal LM for evaluation: plain checkpoints through
`from_pretrained`, optkit artifacts of every format through the format's reader."""

from pathlib import Path

import torch

from optkit.errors import OptkitError
from optkit.families import family_for
from optkit.modeldir import read_config, read_tensors, resolve_model_dir, verify_weights, weight_files
from optkit.quant.formats import reader_for
from optkit.quant.formats.common import check_tensor_shapes
from optkit.quant.formats.mixed import dequantized_state_dict
from optkit.quant.moe import calibration_modules, unfuse_experts


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A causal LM ready for evaluation: plain HF checkpoints through `from_pretrained`; optkit's
    weight-only artifacts through their dequantized weights (the reference semantics); W8A8
    artifacts with int8 linear layers that run int8 matmuls."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.utils import logging as hf_logging

    path = resolve_model_dir(name_or_path)
    verify_weights(path)
    hf_logging.disable_progress_bar()  # optkit shows its own progress
    quant_config = read_config(path).get("quantization_config")
    if quant_config is None:
        return plain_model(path, dtype)
    fmt = reader_for(quant_config, str(path))
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)  # never runs auto_map code, never asks
    del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    family = family_for(config.model_type)
    if family.moe is not None:  # each expert's linears, as the artifact stores them (quant/moe.py)
        unfuse_experts(model.get_decoder().layers, family, config.to_dict(), mode="routed")
        for block in calibration_modules(model):  # built on meta: their weights load below
            block.to_empty(device="cpu").to(dtype).routed_tokens.zero_()
    stored = read_tensors(path)  # named as the checkpoint names them, as a mixed config's targets do
    tensors = {family.module_name(k): v for k, v in stored.items()}
    int8_modules = fmt.w8a8_modules(tensors, quant_config) if fmt.is_w8a8(quant_config) else {}
    for name, module in int8_modules.items():  # W8A8 layers stay int8 and multiply in int8
        model.set_submodule(name, module)

    def in_int8_module(key: str) -> bool:
        return key.rsplit(".", 1)[0] in int8_modules

    if int8_modules:
        state = {k: v for k, v in tensors.items() if not in_int8_module(k)}
    else:
        state = dequantized_state_dict(fmt, stored, quant_config, dtype)  # per-layer schemes when mixed
        state = {family.module_name(k): v for k, v in state.items()}
    check_tensor_shapes(state, model.state_dict(), str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not in_int8_module(k)]
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise OptkitError(
            f"{path}: weights do not match the config (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {unexpected[:3]}): re-create the artifact"
        )
    model.tie_weights()
    return model.eval()


def plain_model(path: Path, dtype: torch.dtype = torch.float32):
    """A model directory without quantization_config through transformers (safetensors only, no
    auto_map code); weights whose shapes config.json contradicts are one OptkitError."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    except RuntimeError as e:
        if "size mismatch" not in str(e) and "ignore_mismatched_sizes" not in str(e):
            raise
        check_tensor_shapes(_stored_shapes(path), _meta_state(path), str(path))  # names the tensor
        raise OptkitError(f"{path}: its weights do not have the shapes its config.json gives: fix config.json") from e
    return model.eval()


def _stored_shapes(path: Path) -> dict[str, torch.Tensor]:
    """Each stored tensor as an empty meta tensor of its shape (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for file in weight_files(path):
        with safe_open(file, "pt") as f:
            shapes |= {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    return shapes


def _meta_state(path: Path) -> dict[str, torch.Tensor]:
    """What config.json builds, on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, trust_remote_code=False)).state_dict()
