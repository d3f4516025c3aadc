"""A .gguf back as a Hugging Face config and state dict, for optkit's runtime and the gate's checks.

Quantized blocks (Q4_0, Q4_1, Q8_0) are dequantized as ggml's dequantize_row_* computes them
(weights/gguf_blocks.py), Llama's q/k rows go back to Hugging Face's order: what llama.cpp holds,
as plain float32 weights (the reference path; llama.cpp itself multiplies with 8-bit activations).
"""

from pathlib import Path

import numpy as np
import torch

from optkit.errors import OptkitError
from optkit.quant.formats import gguf_metadata as meta
from optkit.weights import gguf_blocks

MAGIC = b"GGUF"
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise OptkitError(f"{path} is not a readable GGUF file ({e}): re-create it") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(path: str | Path) -> dict:
    """The Hugging Face config.json the file's metadata describes."""
    reader = _reader(Path(path))
    return _config(reader, Path(path))


def _config(reader, path: Path) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _MODEL_TYPES:
        raise OptkitError(f"{path}: GGUF architecture {arch!r} is not one optkit runs (llama, qwen2, qwen3)")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": _MODEL_TYPES[arch],
        "architectures": [_CLASSES[arch]],
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float(f"{_field(reader, f'{arch}.attention.layer_norm_rms_epsilon'):.7g}"),  # a float32 in GGUF
        "rope_parameters": {"rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0), "rope_type": "default"},
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        config["rope_parameters"].update(rope_type="linear", factor=_field(reader, f"{arch}.rope.scaling.factor"))
    if "rope_freqs.weight" in names:
        raise OptkitError(f"{path}: Llama 3.1 RoPE scaling is read back by llama.cpp only, not by optkit's runtime")
    return config


def read_file(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, float32 state dict with Hugging Face names)."""
    from gguf import GGMLQuantizationType as T

    path = Path(path)
    reader = _reader(path)
    config = _config(reader, path)
    state = {}
    for tensor in reader.tensors:
        hf = meta.hf_name(tensor.name)
        data = torch.from_numpy(np.array(tensor.data))
        kind = tensor.tensor_type.name
        if kind in gguf_blocks.BLOCK_BYTES:
            cols = data.shape[1] // gguf_blocks.BLOCK_BYTES[kind] * gguf_blocks.BLOCK
            weight = gguf_blocks.dequantize(kind, data, cols)
        elif tensor.tensor_type == T.BF16:
            weight = data.view(torch.bfloat16).float()
        elif tensor.tensor_type in (T.F16, T.F32):
            weight = data.float()
        else:
            raise OptkitError(f"{path}: {tensor.name} is {kind}; optkit reads F32, F16, BF16, Q4_0, Q4_1, Q8_0")
        heads = meta.qk_heads(config, hf)
        state[hf] = meta.unpermute_qk(weight, heads) if heads is not None else weight
    return config, state


def write_model_dir(path: str | Path, out: Path) -> Path:
    """The .gguf as a plain Hugging Face model directory (config.json, float32 model.safetensors),
    which optkit's runtime and transformers load: the reference path llama.cpp's results are checked against."""
    import json

    from safetensors.torch import save_file

    config, state = read_file(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out
