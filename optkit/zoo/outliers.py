"""A copy of a model with activation outliers and the same function (for W8A8 tests and benches).

Large models have a few activation channels far larger than the rest; small ones do not. For
each decoder layer, a few channels of each norm's weight are multiplied by c and the matching
input columns of the linears it feeds are divided by c: norm(x)·w·c feeds W/c, so the output is
unchanged, but the activations now have outliers. c is a power of two (32 or 64), so the change
is exact in bf16 as well.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from optkit.artifacts import atomic_output_dir
from optkit.modeldir import resolve_model_dir, weight_files

# norm -> the linears that read its output (Llama-family names)
NORM_CONSUMERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
FACTORS = (32.0, 64.0)


def add_activation_outliers(
    model: str | Path, out: Path, *, channels: int = 4, seed: int = 0, overwrite: bool = False
) -> Path:
    base = resolve_model_dir(model)
    config = json.loads((base / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        for path in base.iterdir():
            if path.is_file() and path not in weight_files(base):
                shutil.copy2(path, tmp / path.name)
        for file in weight_files(base):
            tensors = load_file(file)
            for layer in range(config["num_hidden_layers"]):
                prefix = f"model.layers.{layer}"
                for norm, consumers in NORM_CONSUMERS.items():
                    key = f"{prefix}.{norm}.weight"
                    if key not in tensors:
                        continue
                    picked = torch.randperm(tensors[key].numel(), generator=generator)[:channels]
                    factors = torch.tensor(FACTORS)[torch.randint(len(FACTORS), (channels,), generator=generator)]
                    tensors[key][picked] *= factors.to(tensors[key].dtype)
                    for consumer in consumers:
                        weight = tensors[f"{prefix}.{consumer}.weight"]
                        weight[:, picked] /= factors.to(weight.dtype)
            save_file(tensors, tmp / file.name, metadata={"format": "pt"})
    return out
