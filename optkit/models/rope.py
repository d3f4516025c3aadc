"""RoPE parameters and frequencies, formula for formula as transformers' `modeling_rope_utils`, so
positions rotate exactly as in the transformers model: default, linear, dynamic (static within
max_position_embeddings), Llama 3.1, YaRN and LongRoPE."""

import math
from collections.abc import Mapping

import torch

from optkit.errors import OptkitError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
DEFAULT_THETA = 10000.0


def standardize_rope(config: dict, max_positions: int, aliases: Mapping[str, str]) -> dict:
    """RoPE parameters in transformers 5's `rope_parameters` form, from either that key or the
    older `rope_theta` + `rope_scaling` pair (as transformers does, `rope_scaling` wins). `aliases`:
    old rope_type names the family's config class reads as another (families/: ConfigReading)."""
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if not 0 < partial <= 1:
        raise OptkitError(f"partial_rotary_factor {partial} is not in (0, 1]: fix config.json")
    if partial != 1.0:  # Phi-4 mini: RoPE on the first head_dim · partial dimensions (ModelConfig.rotary_dim)
        rope["partial_rotary_factor"] = partial
    if isinstance(rope["rope_type"], str) and rope["rope_type"] in aliases:
        rope["rope_type"] = aliases[rope["rope_type"]]
    if rope["rope_type"] not in ROPE_TYPES:
        raise OptkitError(
            f"rope_type {rope['rope_type']!r} is not supported: the runtime implements {', '.join(ROPE_TYPES)}"
        )
    missing = [k for k in ("short_factor", "long_factor") if rope["rope_type"] == "longrope" and k not in rope]
    if missing:
        raise OptkitError(f"rope_type 'longrope' without {' and '.join(missing)}: fix rope_scaling in config.json")
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", rope.get("original_max_position_embeddings", max_positions)
        )
    return rope


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # inv_freq[i] = 1 / theta^(2i / dim), in float32 as transformers computes it
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def rope_frequencies(
    rope: dict, dim: int, max_positions: int, context_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """inv_freq [dim / 2] and the attention scaling of cos/sin for standardized `rope`, where `dim` is
    the rotary dimension (head_dim · partial_rotary_factor), for sequences of up to `context_len`."""
    rope_type, theta = rope["rope_type"], rope["rope_theta"]
    if rope_type == "default":
        return _base_inv_freq(theta, dim), 1.0
    if rope_type == "linear":  # positions divided by `factor`, the same as dividing inv_freq
        return _base_inv_freq(theta, dim) / rope["factor"], 1.0
    if rope_type == "dynamic":
        # Dynamic NTK raises theta to theta·(factor·L / max_positions − (factor − 1))^(dim / (dim − 2))
        # once the length L exceeds max_position_embeddings; up to there the factor is 1, plain RoPE.
        # Approximated as static at L = max_position_embeddings: exactly transformers' frequencies
        # within that length, and no rescaling beyond it.
        return _base_inv_freq(theta, dim), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(rope, theta, dim), 1.0
    if rope_type == "longrope":
        return _longrope_frequencies(rope, theta, dim, max_positions, context_len or max_positions)
    assert rope_type == "yarn", rope_type  # standardize_rope refused the rest
    return _yarn_frequencies(rope, theta, dim, max_positions)


def _llama3_inv_freq(rope: dict, theta: float, dim: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = _base_inv_freq(theta, dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(rope: dict, theta: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, extrapolate high ones, ramp between;
    cos and sin are scaled by 0.1·ln(factor) + 1 (or the given attention_factor)."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength fits `num_rotations` times into the original context
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope_frequencies(
    rope: dict, theta: float, dim: int, max_positions: int, context_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): inv_freq[i] = 1 / (ext[i] · theta^(2i / dim)), ext = long_factor for sequences
    longer than original_max_position_embeddings, short_factor otherwise (transformers chooses by
    the forward's max position + 1; the runtime by its context limit: docs/runtime.md); cos and sin
    scaled by √(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(rope["long_factor" if context_len > original else "short_factor"], device="cpu")
    if ext.shape != (dim // 2,):
        raise OptkitError(
            f"LongRoPE factors have {ext.numel()} entries but the rotary dimension {dim} needs {dim // 2}: "
            "fix rope_scaling in config.json"
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext * theta**shape), attention_factor
