"""GPTQ's settings; the field names are the recipe keys (`quantize.gptq`)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator


class GPTQOptions(BaseModel):
    """GPTQ settings; the field names are the recipe keys. act_order, static_groups and scale left
    unset (None) take the output format's defaults (`resolved`): off and minmax, except where the
    format names others (formats/gguf.py: Q4_0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = 128
    damp: float = 0.01  # fraction of the mean diagonal of H added to it
    act_order: bool | None = None  # quantize columns by descending H_ii (the most sensitive first)
    static_groups: bool | None = None  # group parameters from the unpermuted W: contiguous g_idx
    # how a group's symmetric scale is chosen: max|w| / 7.5 (for 4 bits), or llama.cpp's signed m / −8
    scale: Literal["minmax", "signed_max"] | None = None
    max_damp_retries: int = 6  # each retry multiplies the dampening by 10

    def resolved(self, defaults: dict | None = None) -> "GPTQOptions":
        """These options with each unset setting taken from `defaults` (a format's), else the plain default."""
        plain = {"act_order": False, "static_groups": False, "scale": "minmax"} | (defaults or {})
        return self.model_copy(update={k: v for k, v in plain.items() if getattr(self, k) is None})

    @field_validator("damp")
    @classmethod
    def _damp_not_negative(cls, value: float) -> float:
        if not value >= 0:
            raise ValueError("must be ≥ 0")
        return value

    @field_validator("block_size")
    @classmethod
    def _block_size_positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be ≥ 1")
        return value
