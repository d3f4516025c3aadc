"""The options of `optkit speculator train` (and of a recipe's `speculator:` section)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Options that change the trained weights: a checkpoint resumes only under the same values.
TRAINING_FIELDS = ("data", "steps", "batch_size", "seq_len", "learning_rate", "warmup_steps", "noise", "seed")
EAGLE3_FIELDS = ("kind", "draft_vocab_size", "ttt_steps")  # and these for an EAGLE-3 head


class SpeculatorTrainOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # eagle1: fc(embedding, last feature) into a layer of the target's family, the target's LM head;
    # eagle3: three layers' features fused, the training-time test, its own reduced-vocabulary head
    kind: Literal["eagle1", "eagle3"] = "eagle1"
    # EAGLE-3: the draft vocabulary, the most frequent tokens of the training text (None: a quarter
    # of the target's vocabulary, as EAGLE-3's 32k of Llama 3's 128k, and at least 1,024)
    draft_vocab_size: int | None = Field(None, ge=1)
    ttt_steps: int = Field(3, ge=1, le=16)  # EAGLE-3: drafting steps unrolled by the training-time test
    data: str = "distill"  # bundled text set or a local .txt/.jsonl/.parquet file: any text the target reads
    steps: int = Field(800, ge=1)
    batch_size: int = Field(8, ge=1)  # windows per step
    seq_len: int = Field(256, ge=4)
    learning_rate: float = Field(2e-3, gt=0)
    warmup_steps: int = Field(40, ge=0)
    # width of the uniform noise added to the target's features during training (EAGLE: the head
    # must extend its own, imperfect, predicted features at drafting time)
    noise: float = Field(0.2, ge=0)
    seed: int = 0
    checkpoint_every: int = Field(100, ge=1)
    # the final report's offline acceptance: chains of k drafts on held-out text
    num_speculative_tokens: int = Field(4, ge=1)
    eval_set: str = "heldout"
    eval_prompts: int = Field(8, ge=1)
    eval_new_tokens: int = Field(64, ge=2)  # the target's greedy continuation of each prompt

    def training_values(self) -> dict:
        names = TRAINING_FIELDS + (EAGLE3_FIELDS if self.kind == "eagle3" else ())
        return {name: getattr(self, name) for name in names}


class SpeculatorSection(SpeculatorTrainOptions):
    """A recipe's `speculator:` section: the release ships an EAGLE head for its artifact, trained
    here on the artifact's features (or taken from `path`), and the report compares it with a
    head for the base (trained here too, or `base_path`). `num_speculative_tokens` is the k at
    which `gate.min_acceptance_length` is measured."""

    path: str | None = None  # a head already trained for the artifact (optkit speculator train ARTIFACT)
    base_path: str | None = None  # a head already trained for the base model
