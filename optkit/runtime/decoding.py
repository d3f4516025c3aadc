"""How an engine turns a step's logits into tokens: one `Decoding` per engine, plain or speculative.

Each step the engine asks its decoding to `propose` (fill the scheduled sequences' proposals, if
it makes any) before the model runs, then to `sample` the model's logits into the tokens each
sequence appends; it `release`s a sequence that finished, was aborted or was preempted, and reads
its `stats` into EngineStats. `PlainDecoding` samples one token per sequence;
`speculative.Speculator` proposes tokens and verifies them (runtime/speculative.py). A decoding whose
proposer reads the target's features (EAGLE) says so in `needs_hidden` and names them in
`feature_layers`: the engine then runs the step with ModelRunner.run_with_hidden and, after `sample`,
hands `observe` those features of every token it ran.
"""

from typing import Protocol

import torch

from optkit.runtime.engine_args import EngineConfig
from optkit.runtime.sampler import Sampler, TokenLogprobs
from optkit.runtime.scheduler import ScheduledSequence
from optkit.runtime.sequence import Sequence

# tokens to append per seq_id, and their logprobs for the sequences that asked
Sampled = tuple[dict[int, list[int]], dict[int, list[TokenLogprobs]]]


class DecodingStats(Protocol):
    def engine_fields(self) -> dict:
        """These counters under EngineStats' names (none: {})."""
        ...


class Decoding(Protocol):
    stats: DecodingStats
    needs_hidden: bool  # sample wants the hidden states of every token the step ran
    feature_layers: tuple[int, ...]  # which (ModelRunner.run_with_hidden): (-1,) the last, after the norm

    def propose(self, scheduled: list[ScheduledSequence]) -> None: ...

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], scheduled: list[ScheduledSequence], sampler: Sampler
    ) -> Sampled:
        """logits [R, V] from ModelRunner.run for `seqs` -> the tokens each appends (and logprobs)."""
        ...

    def observe(self, scheduled: list[ScheduledSequence], tokens: dict[int, list[int]], hidden: torch.Tensor) -> None:
        """With `needs_hidden`: the step's hidden states [T, H] (run_with_hidden) and the tokens
        `sample` chose for it."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished, was aborted or preempted: drop what is held for it."""
        ...


class _NoStats:
    def engine_fields(self) -> dict:
        return {}


class PlainDecoding:
    """No proposals: one token per sampling sequence, from its one row of logits."""

    stats = _NoStats()
    needs_hidden = False
    feature_layers = ()

    def propose(self, scheduled: list[ScheduledSequence]) -> None:
        pass

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], scheduled: list[ScheduledSequence], sampler: Sampler
    ) -> Sampled:
        result = sampler(logits, seqs)
        tokens = {seq.seq_id: [token] for seq, token in zip(seqs, result.token_ids, strict=True)}
        logprobs = {seq.seq_id: [lp] for seq, lp in zip(seqs, result.logprobs, strict=True) if lp is not None}
        return tokens, logprobs

    def observe(self, scheduled: list[ScheduledSequence], tokens: dict[int, list[int]], hidden: torch.Tensor) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


def make_decoding(config: EngineConfig, target, tokenizer, num_blocks: int, target_dir) -> Decoding:
    """The decoding `config` asks for: speculative with `speculative` set, else plain (`target_dir`:
    the target's model directory, which an EAGLE head must have been trained for)."""
    if not config.speculative:
        return PlainDecoding()
    from optkit.runtime.proposers import make_proposer
    from optkit.runtime.speculative import Speculator

    proposer = make_proposer(
        config.speculative, target, tokenizer, num_blocks, config.block_size,
        config.enable_prefix_caching, getattr(torch, config.dtype), config.device, target_dir,
    )  # fmt: skip
    return Speculator(proposer, config.num_speculative_tokens)
