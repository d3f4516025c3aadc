"""Logits -> next tokens, one row per sequence, each row with its own SamplingParams.

Order, as in vLLM: logprobs are taken from the raw logits; then penalties (repetition over prompt
and output, frequency and presence over output); greedy rows take the argmax; the others are
divided by their temperature, filtered by min-p, top-k and top-p, and sampled. A request with a
seed draws from its own torch.Generator, kept across steps, so its tokens do not depend on what
it is batched with nor on preemption (it draws exactly once per sampled token).

`sampling_probs` is the distribution a row samples from once penalties are applied; speculative
decoding (runtime/speculative.py) verifies proposals against it.
"""

from dataclasses import dataclass

import torch

from optkit.kernels import cpu_decode
from optkit.runtime.sequence import SamplingParams, Sequence

_GREEDY_BELOW = 1e-5  # temperatures this small overflow logits / t: treat them as greedy


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask for logprobs


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_BELOW


def has_penalties(params: SamplingParams) -> bool:
    return params.has_penalties


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> its seeded generator

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's generator."""
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        # logits: [N, V], row i for seqs[i]
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), f"{tuple(logits.shape)} vs {len(seqs)} seqs"
        logits = logits.float()
        params = [s.params for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None

        if all(is_greedy(p) and not has_penalties(p) for p in params):
            token_ids = cpu_decode.argmax(logits)
        else:
            logits = apply_penalties(logits, seqs)
            token_ids = self._sample(logits, seqs)

        token_list = token_ids.tolist()
        logprobs = gather_logprobs(raw_logprobs, token_ids, params) if raw_logprobs is not None else None
        return SampleResult(token_list, logprobs or [None] * len(seqs))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        greedy = torch.tensor([is_greedy(p) for p in params], device=logits.device)
        token_ids = cpu_decode.argmax(logits)
        if bool(greedy.all()):
            return token_ids

        probs = sampling_probs(logits, params)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None and not is_greedy(seq.params):
                noise[row].exponential_(generator=self.generator(seq, logits.device))
        return torch.where(greedy, token_ids, exponential_race(probs, noise))

    def generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        """The seeded sequence's own generator, created on first use."""
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = generator
        return generator


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] logits (penalties already applied) -> the [N, V] probabilities each row samples
    from: divided by the temperature, then filtered by min-p, top-k and top-p. Greedy rows keep
    temperature 1 (their callers take the argmax instead)."""
    temperature = torch.tensor([1.0 if is_greedy(p) else p.temperature for p in params], device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    logits = apply_min_p(logits, [p.min_p for p in params])
    logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    return torch.softmax(logits, dim=-1)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) draws i with probability p_i / sum(p)
    (p need not be normalised). probs, noise [N, V] -> long [N]; noise is clamped in place."""
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a zero draw would turn 0 / 0 into a NaN maximum
    return (probs / noise).argmax(dim=-1)


def _token_index(rows: list[list[int]], device: torch.device, pad: int) -> torch.Tensor:
    """Ragged token lists -> [N, L] int64, padded with `pad`."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] float: how often each token occurs in each row's list (padding lands in an extra column)."""
    index = _token_index(rows, device, pad=vocab_size)
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (CTRL: over prompt and output, positive logits divided, negative
    multiplied), then frequency and presence penalties (OpenAI: over output tokens,
    logit -= frequency * count + presence * [count > 0]). Only rows that ask are touched."""
    rows = [i for i, s in enumerate(seqs) if has_penalties(s.params)]
    if not rows:
        return logits
    logits = logits.clone()
    device, vocab_size = logits.device, logits.shape[1]
    chosen = [seqs[i] for i in rows]
    row_index = torch.tensor(rows, device=device)
    sub = logits[row_index]  # [R, V]

    repetition = torch.tensor([s.params.repetition_penalty for s in chosen], device=device).unsqueeze(1)
    seen = _token_counts([s.token_ids for s in chosen], vocab_size, device) > 0
    penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalized, sub)

    frequency = torch.tensor([s.params.frequency_penalty for s in chosen], device=device).unsqueeze(1)
    presence = torch.tensor([s.params.presence_penalty for s in chosen], device=device).unsqueeze(1)
    counts = _token_counts([s.output_token_ids for s in chosen], vocab_size, device)
    sub = sub - frequency * counts - presence * (counts > 0).float()

    logits[row_index] = sub
    return logits


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's most likely token's."""
    if not any(min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = torch.tensor(min_p, device=logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's k most likely tokens (0: all; ties at the k-th value are kept), then the
    smallest set of those whose probability adds up to top_p (always at least one)."""
    use_k, use_p = any(k > 0 for k in top_k), any(p < 1 for p in top_p)
    if not (use_k or use_p):
        return logits
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    if use_k:
        k = torch.tensor([min(k, vocab_size) if k > 0 else vocab_size for k in top_k], device=logits.device)
        kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    if use_p:
        p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of the tokens ranked above
        drop = (mass_before >= p) & (p < 1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """The sampled token's logprob and the top-k, for the rows that asked (k = params.logprobs)."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = max(p.logprobs or 0 for p in params)
    top_values, top_ids = raw_logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    top_values = top_values.tolist() if top_values is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    result: list[TokenLogprobs | None] = []
    for row, (p, token) in enumerate(zip(params, token_ids.tolist(), strict=True)):
        if p.logprobs is None:
            result.append(None)
            continue
        top = list(zip(top_ids[row][: p.logprobs], top_values[row][: p.logprobs], strict=True)) if p.logprobs else []
        result.append(TokenLogprobs(token, chosen[row], top))
    return result
