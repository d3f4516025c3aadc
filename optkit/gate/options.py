"""What a gate checks and what it evaluates on: `optkit eval`'s flags and a recipe's `gate:` section
(field names are the keys)."""

from pydantic import ConfigDict, model_validator

from optkit.gate.thresholds import Thresholds


class GateOptions(Thresholds):
    """Thresholds plus what the gate evaluates on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _recovery_defaults_with_a_task(cls, data):
        """A task without an explicit min_recovery is gated at 0.95, as practitioners do."""
        if isinstance(data, dict) and data.get("task") and "min_recovery" not in data:
            data = {**data, "min_recovery": 0.95}
        return data

    eval_set: str = "heldout"
    seq_len: int = 256
    max_windows: int | None = None
    task: str | None = None  # multiple-choice task for accuracy and min_recovery (e.g. next_line)
    reference_cache: bool = False  # cache the base's top-k log-probs: reruns never load the base
    top_k: int = 256
