"""AWQ's settings; the field names are the recipe keys (`quantize.awq`)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict


class AWQOptions(BaseModel):
    """AWQ settings; the field names are the recipe keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grid: int = 20  # α ∈ {0, 1/grid, ..., (grid-1)/grid}
    duo_scaling: Literal["both", "on", "off"] = "both"  # search s = |x|^α, s = |x|^α / |w|^(1-α), or both
    clip: bool = True
    # AutoAWQ shrinks ±max|w| as one bound and skips q/k; here asymmetric integers get each end of a
    # group's range shrunk on its own, and q/k are clipped (why: docs/results.md)
    clip_ends: Literal["independent", "shared"] = "independent"
    clip_qk: bool = True
    max_shrink: float = 0.5  # clipping search: shrink each group's range by up to this fraction
    clip_steps: int = 20
    clip_tokens: int = 512  # tokens sampled for the clipping search (AutoAWQ's n_sample_token)
    search_samples: int = 32  # calibration sequences used by the scale and clip searches
