"""A request's state as the scheduler sees it: token ids, how many of them have KV in the cache,
its block tables, and how it samples. No torch."""

import itertools
import math
import time
from dataclasses import dataclass, field
from enum import Enum


class SequenceStatus(Enum):
    WAITING = "waiting"  # not yet admitted, or preempted (its KV freed, to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string (the OpenAI API's name)
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away


@dataclass
class SamplingParams:
    """How one request samples; field names and meanings follow the OpenAI API and vLLM."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages prompt and output tokens (CTRL's rule); in [0.01, 10]
    frequency_penalty: float = 0.0  # OpenAI: subtract freq * count of each output token
    presence_penalty: float = 0.0  # OpenAI: subtract presence once per token seen in the output
    seed: int | None = None  # reproducible sampling for this request, whatever it is batched with
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()  # any iterable; kept as a set (checked every token)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top k
    speculative: bool = True  # False: never speculate for this request, even when the engine does

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.stop_token_ids)
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in floats:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0 or self.top_k == -1, "top_k must be >= 0 (0 or -1: all tokens)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            # 1e-300 would divide logits by zero in float32
            (0.01 <= self.repetition_penalty <= 10, "repetition_penalty must be in [0.01, 10]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.seed is None or -(2**63) <= self.seed < 2**63, "seed must fit in 64 bits"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens so far (repetition, frequency or presence penalties)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


_ids = itertools.count()


class Sequence:
    """Prompt plus generated tokens. `num_computed_tokens` of them have their KV in the cache
    (`num_cached_tokens` of those came from the prefix cache, not from a prefill)."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams | None = None, request_id: str = ""):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.seq_id = next(_ids)
        self.request_id = request_id or str(self.seq_id)
        self.params = params or SamplingParams()
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_tables: list[list[int]] = []  # one per KV cache group (runtime/kv_groups.py); [] when none held
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's block table (the only one, but for Gemma's mixed layers)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
