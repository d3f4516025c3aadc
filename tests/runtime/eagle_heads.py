"""Untrained EAGLE heads for tests: random weights in the on-disk layout (optkit/speculative/eagle_head.py)."""

from pathlib import Path

import torch

from optkit.modeldir import read_config
from optkit.models.config import ModelConfig
from optkit.runtime.eagle_layer import layer_shapes
from optkit.speculative.eagle_head import LAYER_PREFIX, head_config_for, save_head


def head_tensors(target_dir: Path, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """fc.weight and the layer's tensors for `target_dir`, random (norm weights near 1)."""
    config = head_config_for(target_dir)
    generator = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * scale}
    for name, shape in layer_shapes(ModelConfig.from_hf(read_config(target_dir)), config).items():
        noise = torch.randn(shape, generator=generator) * scale
        tensors[LAYER_PREFIX + name] = (1 + noise) if "norm" in name else noise
    return tensors


def random_head(target_dir: Path, out: Path, seed: int = 0, scale: float = 0.05) -> Path:
    """A random head trained for nothing, but for `target_dir` by its digest."""
    save_head(out, head_config_for(target_dir), head_tensors(target_dir, seed, scale), overwrite=True)
    return out


def echo_head(target_dir: Path, out: Path) -> Path:
    """A head whose layer adds nothing (o_proj and down_proj zero) to fc's copy of the feature: it
    predicts the feature it was given, so it proposes the target's last token again and again, which
    the target accepts where it repeats itself (partial acceptance without training)."""
    tensors = head_tensors(target_dir)
    hidden = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1)
    tensors[LAYER_PREFIX + "self_attn.o_proj.weight"].zero_()
    tensors[LAYER_PREFIX + "mlp.down_proj.weight"].zero_()
    save_head(out, head_config_for(target_dir), tensors, overwrite=True)
    return out
