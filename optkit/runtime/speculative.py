"""Speculative decoding: a cheap proposer guesses the next tokens of each decoding sequence, the
target scores all the guesses in one forward pass over the paged cache, and the sequence keeps
the longest run of guesses the target agrees with plus one token of the target's own. Exact:
greedy output is plain greedy decoding's, token for token; sampled output is distributed as the
target's. Continuous batching stays on: sequences with and without proposals share a step.

One engine step with speculation (runtime/engine.py):
  1. the scheduler reserves 1 + k tokens of budget and KV slots for each decoding sequence;
  2. the proposer (runtime/proposers.py: a draft model, n-gram prompt lookup, or an EAGLE head:
     runtime/eagle_proposer.py) fills each one's `spec_token_ids` d_1..d_n (n <= k) and, for a
     model, their distributions q_1..q_n;
  3. the target runs x_L (the last token, whose KV is not cached yet) and d_1..d_n as one chunk of
     n + 1 tokens at positions L-1 .. L+n-1; its logits row i gives p_{i+1} = p(. | x, d_1..d_i);
  4. `Speculator.sample` keeps d_1..d_a and adds one token t of the target's (1..n + 1 tokens);
  5. the scheduler appends them, counts the KV of x_L, d_1..d_a as computed (num_computed_tokens
     += 1 + a) and frees the blocks past that. Rejected proposals' KV lies beyond
     num_computed_tokens: it is never hashed into the prefix cache and is overwritten later;
  6. a proposer that declares `feature_layers` (EAGLE) is handed, per speculating sequence, the
     target's hidden states of the positions this step verified: every token run for a prefill
     chunk or a plain decode, x_L and d_1..d_a after a verification (`Proposer.observe`).

Verification (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling", Algorithm 2), with p and q both after the request's penalties, temperature, min-p,
top-k and top-p (sampler.sampling_probs):
  accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), for i = 1..n, until the first rejection j;
  rejected at j:     t ~ normalize(max(0, p_j - q_j))     (the correction)
  all n accepted:    t ~ p_{n+1}                          (the bonus token)
It is exact because, with residual r = max(0, p - q) / sum(max(0, p - q)) and
sum_x max(0, p(x) - q(x)) = 1 - sum_x min(p(x), q(x)) = P(reject),
  P(emit x) = q(x) min(1, p(x) / q(x)) + P(reject) r(x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x).
The n-gram proposer's q is a point mass at d: d is kept with probability p(d), else t ~ p without d.
Greedy rows are the temperature -> 0 limit: d_i is kept while d_i = argmax p_i; t = argmax p_{a+1}.

How many tokens a sequence may propose adapts to how its last proposals fared: after a rejection
at d_{a+1} at most a + 1 next step, after full acceptance twice as many (up to k). Every verified
token costs the target compute (all of it on a CPU) and a draft model a forward pass, so guesses
that keep failing are cut short while runs the proposer predicts well grow back at once. The
rule only looks at the sequence's own tokens: it never depends on the batch.
"""

from dataclasses import dataclass

import torch

from optkit.runtime.sampler import (
    Sampler,
    TokenLogprobs,
    apply_penalties,
    exponential_race,
    gather_logprobs,
    has_penalties,
    is_greedy,
    sampling_probs,
)
from optkit.runtime.scheduler import ScheduledSequence
from optkit.runtime.sequence import Sequence


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised: what p puts on tokens beyond what q already proposed. [N, V]."""
    return (p - q).clamp_min(0)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The modified rejection sampling above, for N rows of up to K proposals at once.

    target_probs [N, K+1, V]: p_1..p_{K+1};  draft_probs [N, K, V]: q_1..q_K, or None for point
    masses at the proposals (n-gram);  draft_token_ids long [N, K]: d_1..d_K;  num_drafts long [N]:
    row b has n_b <= K proposals (the rest is padding);  uniform [N, K] ~ U[0, 1);  noise [N, V] ~
    Exp(1), for the one token drawn from the residual or p.
    Returns token ids long [N, K+1] (d_1..d_a, t, then -1) and the number accepted a, long [N].
    """
    num_rows, k = draft_token_ids.shape
    rows = torch.arange(num_rows, device=draft_token_ids.device)
    position = torch.arange(k, device=draft_token_ids.device)
    is_draft = position[None, :] < num_drafts[:, None]  # [N, K]
    p_d = target_probs[:, :k].gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)  # p_i(d_i): [N, K]
    q_d = 1.0 if draft_probs is None else draft_probs.gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
    accepted = (uniform * q_d < p_d) & is_draft  # u < p / q, without dividing by q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # a: index of the first rejection, or n

    # t ~ max(0, p_{a+1} - q_{a+1}); past the proposals q is zero, so a = n draws the bonus from p_{n+1}.
    p_next = target_probs[rows, num_accepted]  # [N, V]
    rejected = num_accepted < num_drafts  # [N]
    at = num_accepted.clamp_max(k - 1).unsqueeze(1)  # the rejected proposal's index (clamped for a = K)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(1, draft_token_ids.gather(1, at), 1.0)
    else:
        q_next = draft_probs[rows, at.squeeze(1)]
    q_next = q_next * rejected.unsqueeze(1)
    residual = residual_probs(p_next, q_next)
    # p = q up to rounding leaves nothing to draw from; then any draw from p is as good.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_next)
    token = exponential_race(residual, noise)

    out = torch.where(position[None, :] < num_accepted[:, None], draft_token_ids, -1)
    out = torch.cat((out, out.new_full((num_rows, 1), -1)), dim=1)
    out[rows, num_accepted] = token
    return out, num_accepted


@dataclass
class SpecStats:
    """Counters for one proposer; a 'step' is one sequence's decode step that reserved proposals."""

    proposer: str
    num_steps: int = 0
    num_draft_tokens: int = 0  # proposals made
    num_accepted_tokens: int = 0  # ... that the target accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Accepted proposals per step (each step also adds one token of the target's own)."""
        return self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    def engine_fields(self) -> dict:
        """These numbers under EngineStats' names."""
        return dict(
            spec_proposer=self.proposer,
            num_spec_steps=self.num_steps,
            num_spec_draft_tokens=self.num_draft_tokens,
            num_spec_accepted_tokens=self.num_accepted_tokens,
            spec_acceptance_rate=self.acceptance_rate,
            spec_mean_accepted_tokens=self.mean_accepted_tokens,
        )


class ProposalContext:
    """A sequence followed by its first i proposals: what the target's row i is conditioned on
    (for the penalties, which count the tokens before the one being sampled)."""

    def __init__(self, seq: Sequence, proposals: list[int]):
        self.params = seq.params
        self.token_ids = seq.token_ids + proposals
        self.output_token_ids = self.token_ids[seq.num_prompt_tokens :]


class Speculator:
    """Fills the scheduled sequences' proposals, then turns the target's logits into accepted tokens:
    the engine's speculative `decoding.Decoding`."""

    def __init__(self, proposer, num_speculative_tokens: int):
        self.proposer = proposer  # a proposers.Proposer: n-gram, draft model, EAGLE head
        self.k = num_speculative_tokens
        # a proposer that declares no feature_layers reads no features of the target
        self.feature_layers = tuple(getattr(proposer, "feature_layers", ()))
        self.needs_hidden = bool(self.feature_layers)
        self.stats = SpecStats(proposer.name)
        self._draft_probs: dict[int, torch.Tensor] = {}  # seq_id -> q [n, V] for this step's proposals
        self._allowed: dict[int, int] = {}  # seq_id -> proposals it may make next (the adaptive length)

    def propose(self, scheduled: list[ScheduledSequence]) -> None:
        items = [s for s in scheduled if s.num_lookahead_tokens]
        self._draft_probs.clear()
        if not items:
            return
        wanted = [min(s.num_lookahead_tokens, self._allowed.get(s.seq.seq_id, self.k)) for s in items]
        proposals = self.proposer.propose([(s.seq, k) for s, k in zip(items, wanted, strict=True)])
        for item, (token_ids, probs) in zip(items, proposals, strict=True):
            assert len(token_ids) <= item.num_lookahead_tokens, (len(token_ids), item)
            item.spec_token_ids = token_ids
            if probs is not None and token_ids:
                self._draft_probs[item.seq.seq_id] = probs
        self.stats.num_steps += len(items)

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: the proposer drops what it holds for it."""
        self.proposer.release(seq)
        if seq.is_finished:
            self._allowed.pop(seq.seq_id, None)

    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledSequence], tokens: dict[int, list[int]], hidden: torch.Tensor) -> None:
        """Step 6 above: per speculating sequence, the rows of `hidden` [T, H] (run_with_hidden's pack
        order: each item's new tokens, then its proposals) at the positions `tokens` (what `sample`
        chose) verified, with the first one's position."""
        row = 0
        for item in scheduled:
            seq, num_rows = item.seq, item.num_new_tokens + len(item.spec_token_ids)
            num_verified = item.num_new_tokens + (len(tokens.get(seq.seq_id, [None])) - 1 if item.samples else 0)
            if seq.params.speculative:
                self.proposer.observe(seq, seq.num_computed_tokens, hidden[row : row + num_verified])
            row += num_rows
        assert row == hidden.shape[0], (row, tuple(hidden.shape))

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], scheduled: list[ScheduledSequence], sampler: Sampler
    ) -> tuple[dict[int, list[int]], dict[int, list[TokenLogprobs]]]:
        """logits [R, V] from ModelRunner.run (1 + n rows for a sequence with n proposals) -> the
        tokens to append per seq_id, and their logprobs for the sequences that asked."""
        proposals = {s.seq.seq_id: s.spec_token_ids for s in scheduled if s.spec_token_ids}
        plain, plain_rows, spec, spec_rows = [], [], [], []
        row = 0
        for seq in seqs:
            n = len(proposals.get(seq.seq_id, ()))
            if n:
                spec.append(seq)
                spec_rows.extend(range(row, row + n + 1))
            else:
                plain.append(seq)
                plain_rows.append(row)
            row += n + 1
        assert row == logits.shape[0], (row, tuple(logits.shape))
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list[TokenLogprobs]] = {}
        if plain:
            result = sampler(logits if not spec else logits[plain_rows], plain)
            for seq, token, lp in zip(plain, result.token_ids, result.logprobs, strict=True):
                tokens[seq.seq_id] = [token]
                if lp is not None:
                    logprobs[seq.seq_id] = [lp]
        if spec:
            drafts = [proposals[s.seq_id] for s in spec]
            emitted = self._verify(logits[spec_rows], spec, drafts, sampler)
            for seq, out, draft in zip(spec, emitted, drafts, strict=True):
                tokens[seq.seq_id] = out
                accepted = len(out) - 1
                self.stats.num_draft_tokens += len(draft)
                self.stats.num_accepted_tokens += accepted
                allowed = self._allowed.get(seq.seq_id, self.k)
                self._allowed[seq.seq_id] = min(self.k, 2 * allowed) if accepted == len(draft) else accepted + 1
            logprobs.update(_spec_logprobs(logits[spec_rows], spec, emitted, drafts))
        return tokens, logprobs

    def _verify(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], sampler: Sampler
    ) -> list[list[int]]:
        """logits [R, V], rows 0..n_b of sequence b in turn -> each sequence's emitted tokens."""
        contexts: list = []
        for seq, draft in zip(seqs, drafts, strict=True):
            if has_penalties(seq.params):
                contexts += [ProposalContext(seq, draft[:i]) for i in range(len(draft) + 1)]
            else:
                contexts += [seq] * (len(draft) + 1)
        logits = apply_penalties(logits, contexts)
        emitted: list[list[int]] = [[] for _ in seqs]
        starts = [0]
        for draft in drafts:
            starts.append(starts[-1] + len(draft) + 1)

        greedy = [b for b, seq in enumerate(seqs) if is_greedy(seq.params)]
        if greedy:
            argmax = logits.argmax(dim=-1).tolist()
            for b in greedy:
                target = argmax[starts[b] : starts[b + 1]]
                a = 0
                while a < len(drafts[b]) and drafts[b][a] == target[a]:
                    a += 1
                emitted[b] = drafts[b][:a] + [target[a]]
        sampled = [b for b, seq in enumerate(seqs) if not is_greedy(seq.params)]
        if sampled:
            outs = self._rejection_sample(logits, seqs, drafts, starts, sampled, sampler)
            for b, out in zip(sampled, outs, strict=True):
                emitted[b] = out
        return emitted

    def _rejection_sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: list[list[int]],
        starts: list[int],
        sampled: list[int],
        sampler: Sampler,
    ) -> list[list[int]]:
        """Pads the rows of the sampling sequences (indices `sampled`) to [Ns, K+1, V] and runs
        `rejection_sample` on them; the seeded ones draw from their own generator."""
        device, vocab_size = logits.device, logits.shape[1]
        k = max(len(drafts[b]) for b in sampled)
        rows = [r for b in sampled for r in range(starts[b], starts[b + 1])]
        probs = sampling_probs(logits[rows], [seqs[b].params for b in sampled for _ in range(len(drafts[b]) + 1)])
        target = probs.new_zeros(len(sampled), k + 1, vocab_size)
        draft_ids = torch.zeros(len(sampled), k, dtype=torch.long, device=device)
        uses_q = any(seqs[b].seq_id in self._draft_probs for b in sampled)
        q = probs.new_zeros(len(sampled), k, vocab_size) if uses_q else None
        uniform = torch.rand(len(sampled), k, device=device)
        noise = torch.empty(len(sampled), vocab_size, device=device).exponential_()
        offset = 0
        for i, b in enumerate(sampled):
            n, seq = len(drafts[b]), seqs[b]
            target[i, : n + 1] = probs[offset : offset + n + 1]
            offset += n + 1
            draft_ids[i, :n] = torch.tensor(drafts[b], device=device)
            if q is not None:  # a draft model's; None: the n-gram proposer's point masses
                q[i, :n] = self._draft_probs[seq.seq_id]
            if seq.params.seed is not None:  # a fixed number of draws per step: reproducible
                generator = sampler.generator(seq, device)
                uniform[i, :n] = torch.rand(n, device=device, generator=generator)
                noise[i].exponential_(generator=generator)
        num_drafts = torch.tensor([len(drafts[b]) for b in sampled], device=device)
        out, num_accepted = rejection_sample(target, q, draft_ids, num_drafts, uniform, noise)
        return [row[: a + 1] for row, a in zip(out.tolist(), num_accepted.tolist(), strict=True)]


def _spec_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], emitted: list[list[int]], drafts: list[list[int]]
) -> dict[int, list[TokenLogprobs]]:
    """Logprobs from the raw logits (as the sampler's) of each emitted token, for those that asked."""
    result: dict[int, list[TokenLogprobs]] = {}
    start = 0
    for seq, out, draft in zip(seqs, emitted, drafts, strict=True):
        if seq.params.logprobs is not None:
            raw = torch.log_softmax(logits[start : start + len(out)].float(), dim=-1)
            token_ids = torch.tensor(out, device=logits.device)
            result[seq.seq_id] = gather_logprobs(raw, token_ids, [seq.params] * len(out))
        start += len(draft) + 1
    return result
