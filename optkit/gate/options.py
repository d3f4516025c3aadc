"""What a gate checks and what it evaluates on: `optkit eval`'s flags and a recipe's `gate:` section
(field names are the keys)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from optkit.gate.thresholds import Thresholds
from optkit.quant.ladder import DEFAULT_LADDER, parse_rung


class RepairOptions(BaseModel):
    """`gate.repair`: when the gate fails, raise the precision of the layers that cause the most KLD
    per byte (pipeline/repair.py) until it passes, the size budget is spent or the evaluations are.

    `precisions` is the per-layer ladder (quant/ladder.py): 8 and 16 (full precision) as before, and
    schemes such as 'w4g32' (a finer group), 'w4ch' (per channel), 'w2g64'; the default climbs from
    2-bit g128 (quant/ladder.py's DEFAULT_LADDER). A layer only moves to a rung that takes more bytes
    than the one it is on. `start`: 'artifact' repairs the artifact as it
    was quantized; 'smallest' quantizes every layer on the ladder's smallest rung first and raises
    from there, so the result is the smallest mixed artifact repair finds, even when the artifact
    quantized as asked would already pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_size_mb: float | None = Field(default=None, gt=0)  # model.safetensors, MiB; None: no budget
    precisions: list[int | str] = Field(default_factory=lambda: list(DEFAULT_LADDER), min_length=1)
    start: Literal["artifact", "smallest"] = "artifact"
    max_evaluations: int = Field(default=8, ge=1)  # gate evaluations of repaired candidates
    windows: int = Field(default=8, ge=1)  # attribution windows (held-out calibration text)
    exact_swaps: int = Field(default=3, ge=0)  # exact swaps that calibrate the estimate
    shrink_evaluations: int = Field(default=2, ge=0)  # after a pass: bisect towards fewer raised layers
    reattribute: bool = True  # after a failing candidate: attribute it and plan the next moves from it

    @field_validator("precisions")
    @classmethod
    def _known_precisions(cls, value: list[int | str]) -> list[int | str]:
        labels = {}
        for item in value:
            labels.setdefault(parse_rung(item).label, item)  # ValueError names what is accepted
        return list(labels.values())

    @property
    def rungs(self):
        return [parse_rung(item) for item in self.precisions]


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
    repair: RepairOptions | None = None  # absent: a failing gate is a verdict, nothing more
    # gate/decision.py: `point` compares estimates with the thresholds; `confident` passes only when
    # every one-sided bound at `confidence` is inside, rejects when one is outside (Bonferroni),
    # and otherwise is inconclusive (exit 4)
    decision: Literal["point", "confident"] = "point"
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)  # the decision's one-sided level; intervals shown two-sided
    bootstrap_seed: int = 0  # the bootstrap's resamples (gate/intervals.py): a report is reproducible
    # gate/sequential.py: windows in a random order (seeded by bootstrap_seed), stopping as soon as
    # every threshold is decided at `confidence` (anytime-valid bets; inconclusive if they run out)
    sequential: bool = False
    # what runs the artifact (pipeline/gate_engine.py): None is the artifact's default (transformers,
    # or its format's runtime); vllm reads vLLM's python from OPTKIT_VLLM_PYTHON, never from here
    engine: Literal["transformers", "optkit", "vllm", "llama.cpp"] | None = None
    # mean accepted tokens + 1 per target step of the release's EAGLE head on the eval set, at the
    # recipe's speculator.num_speculative_tokens (pipeline/speculator_stage.py); needs `speculator:`
    min_acceptance_length: float | None = Field(default=None, ge=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _sequential_needs_a_threshold(self):
        if self.sequential and not self.any_set():
            raise ValueError("sequential stops once the thresholds are decided: set at least one (max_kld, ...)")
        return self

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence
