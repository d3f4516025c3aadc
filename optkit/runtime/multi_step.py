"""Multi-step decoding: the tokens of several decode steps run back to back in one engine step
(runtime/scheduler.py decides when, ModelRunner.run_decode_steps runs them). Each step's logits are
sampled as a one-step engine step samples them (the same sampler, seeded generators drawing once per
token in order), so the tokens are those of one step at a time; the scheduler's `update` then
appends them up to the first that stops its sequence. `DecodeStepTokens` is the sampling between
the steps: what each sequence drew, and whether every sequence has already drawn a stop token (the
steps after that are skipped: their tokens would all be dropped).
"""

import torch

from optkit.runtime.decoding import Sampled
from optkit.runtime.sampler import Sampler, TokenLogprobs
from optkit.runtime.sequence import Sequence


class DecodeStepTokens:
    """choose(logits, i) for ModelRunner.run_decode_steps: samples step i's logits [B, vocab] for
    `seqs` and returns the next step's input ids, or None once every sequence drew a stop token."""

    def __init__(self, seqs: list[Sequence], sampler: Sampler, eos_token_ids: tuple[int, ...]):
        self.seqs, self.sampler = seqs, sampler
        self.tokens: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        self.logprobs: dict[int, list[TokenLogprobs]] = {}
        self._stop_ids = [
            seq.params.stop_token_ids | (frozenset() if seq.params.ignore_eos else frozenset(eos_token_ids))
            for seq in seqs
        ]
        self._running = set(range(len(seqs)))  # the sequences that have not drawn a stop token

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor | None:
        result = self.sampler(logits, self.seqs)
        for b, (seq, token, logprobs) in enumerate(zip(self.seqs, result.token_ids, result.logprobs, strict=True)):
            self.tokens[seq.seq_id].append(token)
            if logprobs is not None:
                self.logprobs.setdefault(seq.seq_id, []).append(logprobs)
            if token in self._stop_ids[b]:
                self._running.discard(b)
        if not self._running:
            return None
        return torch.tensor(result.token_ids, dtype=torch.long, device=logits.device)

    def sampled(self) -> Sampled:
        return self.tokens, self.logprobs
