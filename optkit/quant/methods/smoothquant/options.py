"""SmoothQuant's settings; the field names are the recipe keys (`quantize.smoothquant`)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from optkit.quant.activation_options import Activations


class SmoothQuantOptions(BaseModel):
    """SmoothQuant settings; the field names are the recipe keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    smooth: bool = True  # False: plain W8A8, the baseline SmoothQuant improves on
    # "auto" tries no smoothing and α = 0, 1/grid, ..., 1 per smoothing group (α = 0 still smooths:
    # s = 1/max|W_j| flattens the weights' columns) on half the search samples, and keeps the winner
    # only if it also beats no smoothing on the other half (search_folds, smoothquant.gain_holds)
    alpha: float | Literal["auto"] = "auto"
    alpha_grid: int = 20
    activations: Activations = "dynamic"  # per-token at run time, or one calibrated scale
    search_samples: int = 32

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha_in_unit_interval(cls, value):
        if value == "auto":
            return value
        try:
            alpha = float(value)
        except (TypeError, ValueError):
            alpha = -1.0
        if isinstance(value, bool) or not 0 <= alpha <= 1:
            raise ValueError("give a number in [0, 1] or auto")
        return value
