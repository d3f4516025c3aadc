"""The activation settings of W8A8 methods, apart from the observer (activation_observer.py) so that
registering a method imports no torch: `optkit quantize` builds its flags from the registry, and a
refusal before any work stays instant."""

from typing import Literal

from pydantic import BaseModel, ConfigDict

from optkit.quant.methods import Flag

Activations = Literal["dynamic", "static"]
# the flag of every method with an `activations` setting (smoothquant, w8a8, fp8)
ACT_QUANT = Flag("--act-quant", "activations", "W8A8 activations: dynamic (per token) or static (default dynamic).")


class ActivationOptions(BaseModel):
    """The section of a W8A8 method without other settings (w8a8, fp8); the field is the recipe key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    activations: Activations = "dynamic"  # per-token at run time, or one calibrated scale
