"""Multi-step decoding: the tokens of several decode steps run back to back in one engine step
(runtime/scheduler.py decides when, ModelRunner.run_decode_steps runs them). Each step's logits are
sampled as a one-step engine step samples them (the same sampler, seeded generators drawing once per
token in order), so the tokens are those of one step at a time; the scheduler's `update` then
appends them up to the first that stops its sequence. `DecodeStepTokens` is the sampling between
the steps: what each sequence drew, and whether every sequence has already drawn a stop token (the
steps after that are skipped: their tokens would all be dropped).
"""

import torch

from optkit.kernels import cpu_decode
from optkit.runtime.decoding import Sampled
from optkit.runtime.sampler import Sampler, TokenLogprobs, is_greedy
from optkit.runtime.sequence import Sequence
from optkit.runtime.stopping import is_stop_token


class DecodeStepTokens:
    """choose(logits, i) for ModelRunner.run_decode_steps: samples step i's logits [B, vocab] for
    `seqs` and returns the next step's input ids, or None once every sequence drew a stop token."""

    def __init__(self, seqs: list[Sequence], sampler: Sampler, eos_token_ids: tuple[int, ...]):
        self.seqs, self.sampler = seqs, sampler
        self.tokens: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        self.logprobs: dict[int, list[TokenLogprobs]] = {}
        self._eos_token_ids = eos_token_ids
        self._running = set(range(len(seqs)))  # the sequences that have not drawn a stop token
        # every row the argmax and nothing else asked: the sampler's greedy path without its bookkeeping
        self._argmax = all(is_greedy(seq.params) and seq.params.logprobs is None for seq in seqs)

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor | None:
        if self._argmax:
            chosen = cpu_decode.argmax(logits)  # as Sampler: its float32 logits' argmax
            token_ids, logprobs = chosen.tolist(), [None] * len(self.seqs)
        else:
            result = self.sampler(logits, self.seqs)
            token_ids, logprobs = result.token_ids, result.logprobs
            chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        for b, (seq, token, token_logprobs) in enumerate(zip(self.seqs, token_ids, logprobs, strict=True)):
            self.tokens[seq.seq_id].append(token)
            if token_logprobs is not None:
                self.logprobs.setdefault(seq.seq_id, []).append(token_logprobs)
            if is_stop_token(token, seq.params, self._eos_token_ids):
                self._running.discard(b)
        return chosen if self._running else None

    def sampled(self) -> Sampled:
        return self.tokens, self.logprobs
