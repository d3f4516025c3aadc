"""Continuous batching with chunked prefill and preemption, after vLLM v1's unified scheduler:
each step hands out a token budget, first to the running sequences (one token each when
decoding, a chunk when a prefill is long), then to waiting ones, admitted first come first
served. Prefills and decodes share a step. When the KV cache runs out, the newest running
sequence is preempted: its blocks are freed and it is recomputed later (the prefix cache
may shortcut that). No torch.

With speculative decoding (runtime/speculative.py), a decoding sequence also reserves budget and KV
slots for up to `num_speculative_tokens` proposals (its lookahead); the step then appends 1 to
k + 1 tokens, and the slots of rejected proposals are given back.

With `num_scheduler_steps` n > 1 (multi-step decoding, after vLLM's multi-step scheduling), a step in
which every running sequence decodes and none waits runs up to n decode steps at once: each sequence
reserves the slots of the n - 1 tokens after its next one (the same lookahead), the engine runs them
one after the other without coming back here, and `update` appends them as it appends accepted
proposals (the tokens after a stop dropped, their slots given back). The engine's work around a step
(scheduling, packing, outputs) is then paid once for n tokens; a request that arrives meanwhile waits
for at most n - 1 decode steps. A multi-step computes at most MULTI_STEP_TOKENS tokens in all, fewer
steps the more sequences run: a large batch's step is long and the work around it small by
comparison, while a request that arrives meanwhile would wait longer.
"""

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from optkit.runtime.block_manager import BlockManager
from optkit.runtime.sequence import FinishReason, Sequence, SequenceStatus
from optkit.runtime.stopping import StopLimits, StopStrings, append_until_stop

MULTI_STEP_TOKENS = 64  # tokens a multi-step computes at most (steps × sequences)


@dataclass(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens per step; longer prefills are chunked to it
    max_model_len: int  # prompt plus output, in tokens
    eos_token_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 0  # lookahead slots per decoding sequence (0: no speculation)
    num_scheduler_steps: int = 1  # decode steps per schedule when every sequence decodes (1: one)

    def __post_init__(self) -> None:
        self.eos_token_ids = tuple(self.eos_token_ids)
        checks = [
            (self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}"),
            (
                self.max_num_batched_tokens >= 1,
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
            ),
            (self.max_model_len >= 2, f"max_model_len must be at least 2, got {self.max_model_len}"),
            (all(t >= 0 for t in self.eos_token_ids), f"eos_token_ids must be >= 0, got {self.eos_token_ids}"),
            (
                0 <= self.num_speculative_tokens < self.max_num_batched_tokens,
                f"num_speculative_tokens must be in [0, max_num_batched_tokens), got {self.num_speculative_tokens}",
            ),
            (self.num_scheduler_steps >= 1, f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}"),
            (
                self.num_scheduler_steps == 1 or not self.num_speculative_tokens,
                "num_scheduler_steps above 1 and speculative decoding exclude each other",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class ScheduledSequence:
    """Run tokens `[seq.num_computed_tokens, + num_new_tokens)` of `seq` this step, followed by
    `spec_token_ids`, the proposals (at most `num_lookahead_tokens`) the engine fills in."""

    seq: Sequence
    num_new_tokens: int
    num_lookahead_tokens: int = 0  # budget and KV slots reserved for proposals
    spec_token_ids: list[int] = field(default_factory=list)
    samples: bool = field(init=False)  # the range reaches the end of the sequence: sample a token

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # running sequences first, then the newly admitted ones
    preempted: list[Sequence]
    # decode steps to run (> 1: every scheduled sequence decodes, its lookahead num_steps - 1 tokens)
    num_steps: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self._unfinished: dict[str, Sequence] = {}  # request_id -> sequence
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (again after preemption)
        self.num_prefix_cache_hit_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; refuse one whose prompt can never fit."""
        num_blocks = self.block_manager.max_blocks_held(seq.num_prompt_tokens)
        if seq.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens but max_model_len is {self.config.max_model_len}: "
                f"shorten the prompt to at most {self.config.max_model_len - 1} tokens"
            )
        if num_blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens, which need {num_blocks} KV-cache blocks of "
                f"{self.block_manager.block_size} tokens, but the cache has only {self.block_manager.num_blocks}"
            )
        if seq.request_id in self._unfinished:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        assert seq.status is SequenceStatus.WAITING and not any(seq.block_tables), f"{seq} is not new"
        self._unfinished[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        num_steps = self._num_steps()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            lookahead = num_steps - 1 if num_steps > 1 else self._num_lookahead(seq)
            if num_new + lookahead > budget:
                # A sequence's proposals are all or nothing, so that how many it gets never depends on
                # what it is batched with (seeded sampling stays reproducible); it waits a step.
                break
            while not self.block_manager.allocate_slots(seq, num_new, lookahead):
                victim = self.running.pop()  # the newest; never one already scheduled (those are older)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, num_new, lookahead))
                budget -= num_new + lookahead
                i += 1

        # Admitting while preempting would only thrash: the preempted go first, next step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_cached = self.block_manager.allocate_cached_prefix(seq)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new):
                self._release(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.num_prefix_cache_hit_tokens += min(num_cached, seq.num_prompt_tokens)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, preempted, num_steps)

    def _num_steps(self) -> int:
        """How many decode steps this schedule runs: up to num_scheduler_steps when every running
        sequence decodes one token, none waits, no sampler reads the tokens the steps add
        (penalties), and budget (MULTI_STEP_TOKENS), request ends and free KV blocks have room for all
        of them; else 1."""
        n, running = self.config.num_scheduler_steps, self.running
        if n == 1 or self.waiting or not running:
            return 1
        for seq in running:
            if len(seq) - seq.num_computed_tokens != 1 or seq.params.has_penalties:
                return 1
            remaining = min(seq.params.max_tokens - seq.num_output_tokens, self.config.max_model_len - len(seq))
            n = min(n, remaining, self.block_manager.max_tokens_held - len(seq) + 1)
        n = min(n, min(MULTI_STEP_TOKENS, self.config.max_num_batched_tokens) // len(running))
        # the blocks the steps' slots need beyond those held, in every group: all or none run
        blocks = self.block_manager
        needed = sum(
            max(0, blocks.num_blocks_for(seq.num_computed_tokens + n) - len(table))
            for seq in running
            for table in seq.block_tables
        )
        return n if n > 1 and needed <= blocks.num_free_blocks else 1

    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[int, int | list[int]],
        stop_strings: Mapping[int, StopStrings] | None = None,
    ) -> list[Sequence]:
        """Record a step: advance what is computed, append the sampled tokens (keyed by seq_id; a
        list when speculation accepted proposals: the accepted ones, then the target's own) up to
        the one that stops the sequence (runtime/stopping.py; `stop_strings` watches the text of the
        requests that have stop strings, by seq_id), cache full blocks and finish the sequences that
        stopped. Returns those finished this step."""
        limits = StopLimits(self.config.eos_token_ids, self.config.max_model_len, self.block_manager.max_tokens_held)
        stop_strings = stop_strings or {}
        finished = []
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted while the step ran
                continue
            start = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.num_prompt_tokens_computed += max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - start)
            reason = None
            if seq.num_computed_tokens == len(seq):  # else a prefill chunk short of the end: nothing sampled
                assert seq.seq_id in sampled, f"no token sampled for {seq}"
                tokens = sampled[seq.seq_id]
                tokens = [tokens] if isinstance(tokens, int) else tokens
                reason = append_until_stop(seq, tokens, limits, stop_strings.get(seq.seq_id))
                # Every appended token but the last was a proposal this step ran: its KV is cached.
                seq.num_computed_tokens = len(seq) - 1
            if item.num_lookahead_tokens:
                self.block_manager.free_surplus(seq)  # the slots of rejected proposals
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.free_out_of_window(seq)  # in the sliding-window groups
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a waiting or running sequence and free its blocks; a no-op if already finished."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.request_id]

    def abort(self, request_id: str) -> bool:
        seq = self._unfinished.get(request_id)
        if seq is None:
            return False
        self.finish(seq, FinishReason.ABORT)
        return True

    def _num_lookahead(self, seq: Sequence) -> int:
        """Proposal slots for a decoding sequence: a step appends up to k + 1 tokens, so none are
        reserved past the request's end, max_model_len, or what the whole cache can hold."""
        k = self.config.num_speculative_tokens
        if not k or not seq.params.speculative or seq.num_output_tokens == 0:
            return 0
        if len(seq) - seq.num_computed_tokens != 1:  # a prefill, or a recompute after preemption
            return 0
        remaining = min(seq.params.max_tokens - seq.num_output_tokens, self.config.max_model_len - len(seq))
        room = self.block_manager.max_tokens_held - len(seq)
        return max(0, min(k, remaining - 1, room))

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
