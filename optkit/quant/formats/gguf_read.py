"""A .gguf back as a Hugging Face config and state dict, for optkit's runtime and the gate's checks.

Quantized blocks (Q4_0, Q4_1, Q8_0, and the K-quants Q2_K-Q6_K) are dequantized as ggml's
dequantize_row_* computes them (weights/gguf_blocks.py, weights/kquants), Llama's q/k rows go back
to Hugging Face's order: what llama.cpp holds,
as plain float32 weights (the reference path; llama.cpp itself multiplies with 8-bit activations).
"""

from pathlib import Path

import numpy as np
import torch

from optkit.errors import OptkitError
from optkit.families import family_for
from optkit.quant.formats import gguf_metadata as meta
from optkit.quant.formats.gguf_check import open_for_loading
from optkit.quant.formats.gguf_header import Header
from optkit.quant.formats.gguf_hparams import architecture, layer_values
from optkit.quant.formats.gguf_plan import hf_name
from optkit.quant.formats.gguf_tensors import tensor_arrays, type_name
from optkit.text_safety import printable
from optkit.weights import gguf_blocks, gguf_iq4nl, kquants

MAGIC = b"GGUF"
# llama.cpp architecture -> the model_type it reads back as: those whose metadata says all optkit's
# runtime needs (without experts); llama.cpp runs the others optkit writes (gguf_weights.py reads their weights)
READ_BACK = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC


def read_config(path: str | Path) -> dict:
    """The Hugging Face config.json the file's metadata describes, once its layout, metadata and
    tensor shapes check out (gguf_check.open_for_loading)."""
    return _config(open_for_loading(path))


def _config(header: Header) -> dict:
    path, arch = header.path, architecture(header)
    readable = READ_BACK
    if arch not in readable or header.value(f"{arch}.expert_count"):
        shown = printable(arch)[:40] if arch is not None else None
        runs = ", ".join(sorted(readable))
        raise OptkitError(f"{path}: GGUF architecture {shown!r} is not one optkit runs ({runs}, without experts)")
    model_type = readable[arch]
    sizes = {}
    for key in ("feed_forward_length", "attention.head_count", "attention.head_count_kv"):
        values = layer_values(header, f"{arch}.{key}")
        if values is not None and len(set(values)) > 1:
            raise OptkitError(f"{path}: {arch}.{key} differs between layers; optkit's runtime reads one value")
        sizes[key] = values[0] if values else None
    heads, hidden = sizes["attention.head_count"], header.value(f"{arch}.embedding_length")
    names = {t.name for t in header.tensors}
    config = {
        "model_type": model_type,
        "architectures": [family_for(model_type).model_type(model_type).vllm],
        "num_hidden_layers": header.value(f"{arch}.block_count"),
        "max_position_embeddings": header.value(f"{arch}.context_length"),
        "hidden_size": hidden,
        "intermediate_size": sizes["feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": sizes["attention.head_count_kv"] or heads,
        "head_dim": header.value(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float(f"{header.value(f'{arch}.attention.layer_norm_rms_epsilon'):.7g}"),  # an f32
        "rope_parameters": {"rope_theta": header.value(f"{arch}.rope.freq_base", 10000.0), "rope_type": "default"},
        "vocab_size": len(header.value("tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": header.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": header.value("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    scaling = header.value(f"{arch}.rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):
        raise OptkitError(f"{path}: {arch}.rope.scaling.type is not a string: re-create the file")
    if scaling == "linear":
        factor = header.value(f"{arch}.rope.scaling.factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise OptkitError(f"{path}: linear RoPE scaling without a {arch}.rope.scaling.factor: re-create the file")
        config["rope_parameters"].update(rope_type="linear", factor=factor)
    if "rope_freqs.weight" in names:
        raise OptkitError(f"{path}: Llama 3.1 RoPE scaling is read back by llama.cpp only, not by optkit's runtime")
    return config


def read_file(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, float32 state dict with Hugging Face names)."""
    from gguf import GGMLQuantizationType as T

    header = open_for_loading(path)
    config = _config(header)
    state = {}
    arch = family_for(config["model_type"]).model_type(config["model_type"]).gguf
    for info, array in tensor_arrays(header):
        hf = hf_name(info.name, arch)
        data = torch.from_numpy(np.array(array))
        kind = type_name(info.type_id)
        if kind in (*gguf_blocks.BLOCK_BYTES, *kquants.K_TYPES, "IQ4_NL") and data.dim() != 2:
            raise OptkitError(
                f"{path}: {printable(info.name)} is a {data.dim()}-D {kind} tensor; optkit reads 2-D ones"
            )
        if kind in gguf_blocks.BLOCK_BYTES:
            cols = data.shape[1] // gguf_blocks.BLOCK_BYTES[kind] * gguf_blocks.BLOCK
            weight = gguf_blocks.dequantize(kind, data, cols)
        elif kind in kquants.K_TYPES:  # as gguf-py's dequantize (and ggml's dequantize_row_q*_K) computes them
            weight = kquants.dequantize_rows(data, kind, data.shape[1] // kquants.block_bytes(kind) * kquants.QK_K)
        elif kind == "IQ4_NL":  # llama-quantize's fallback of the i-quants (optkit writes none)
            weight = gguf_iq4nl.dequantize(data, data.shape[1] // gguf_iq4nl.BLOCK_BYTES * gguf_iq4nl.BLOCK)
        elif info.type_id == T.BF16:
            weight = data.view(torch.bfloat16).float()
        elif info.type_id in (T.F16, T.F32):
            weight = data.float()
        else:
            raise OptkitError(
                f"{path}: {info.name} is {kind}; optkit reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                "Q2_K-Q6_K, IQ4_NL"
            )
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
