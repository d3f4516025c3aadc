"""Online quality of a quantized model: the gate's token-level comparison (gate/metrics.py) on the
requests it answered. Pure functions and plain values.

A shadowed request is teacher-forced through both models over (prompt + output). At each
position p that predicts an output token x_{p+1} (p = P-1 .. P+n-2 for a prompt of P tokens and
n output tokens), with P_full and P_quant the two models' next-token distributions:
  KLD(p)  = KL(P_full ‖ P_quant)                        (as `optkit eval`'s kld_mean)
  top1(p) = [argmax P_quant = argmax P_full]            (top1_pct)
  NLL_m(p) = -log P_m(x_{p+1})                          ppl ratio = exp(mean NLL_quant - mean NLL_full)
A `ShadowScore` keeps their sums, so requests (and windows of them) add up token-weighted, the way
the offline gate averages over every token of its eval set.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from optkit.gate.metrics import TokenStats
from optkit.gate.thresholds import Thresholds, check


@dataclass(frozen=True)
class ShadowScore:
    num_tokens: int = 0
    kld_sum: float = 0.0
    top1_matches: int = 0
    nll_full_sum: float = 0.0
    nll_quant_sum: float = 0.0

    def __add__(self, other: "ShadowScore") -> "ShadowScore":
        return ShadowScore(
            self.num_tokens + other.num_tokens,
            self.kld_sum + other.kld_sum,
            self.top1_matches + other.top1_matches,
            self.nll_full_sum + other.nll_full_sum,
            self.nll_quant_sum + other.nll_quant_sum,
        )

    def metrics(self) -> dict[str, float]:
        """The gate's metric names (gate/metrics.py `summarize`), plus the perplexity ratio."""
        n = self.num_tokens
        if n == 0:
            nan = float("nan")
            return {"num_tokens": 0, "kld_mean": nan, "top1_pct": nan, "ppl_ratio": nan, "ppl_increase_pct": nan}
        ratio = math.exp((self.nll_quant_sum - self.nll_full_sum) / n)
        return {
            "num_tokens": n,
            "kld_mean": self.kld_sum / n,
            "top1_pct": 100.0 * self.top1_matches / n,
            "ppl_ratio": ratio,
            "ppl_increase_pct": 100.0 * (ratio - 1.0),
        }

    def json(self) -> dict[str, float | None]:
        """`metrics()` with None for what an empty score cannot tell (JSON has no NaN)."""
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in self.metrics().items()}


def score_rows(full_logits: torch.Tensor, quant_logits: torch.Tensor, targets: torch.Tensor) -> ShadowScore:
    """full_logits, quant_logits [N, V]: both models' logits at N positions; targets [N]: the token
    that followed each position. Scored by the gate's own `TokenStats.add`."""
    num_rows, vocab = full_logits.shape
    if num_rows == 0:
        return ShadowScore()
    # TokenStats scores logits[:, :-1] against tokens[:, 1:]: add a padding row and a leading token
    pad = full_logits.new_zeros(1, vocab)
    tokens = torch.cat([targets.new_zeros(1), targets])[None]
    stats = TokenStats()
    stats.add(torch.cat([full_logits, pad])[None], torch.cat([quant_logits, pad])[None], tokens)
    return ShadowScore(
        num_tokens=num_rows,
        kld_sum=stats.kld[0].double().sum().item(),
        top1_matches=int(stats.top1_match[0].sum().item()),
        nll_full_sum=stats.nll_base[0].double().sum().item(),
        nll_quant_sum=stats.nll_artifact[0].double().sum().item(),
    )


def score_rows_topk(
    local_logits: torch.Tensor,
    top_ids: torch.Tensor,
    top_logp: torch.Tensor,
    target_logp: torch.Tensor,
    targets: torch.Tensor,
    upstream_is_full: bool,
) -> ShadowScore:
    """The score when one model is an upstream that returns only its top k (upstream/prompt_logprobs.py):
    local_logits [N, V]; the upstream's top_ids, top_logp [N, k] and target_logp [N]. The same-top-token
    rate and both NLLs are exact; the KLD sums over S = the upstream's top k and the target, with the
    rest of each distribution one bucket, a lower bound of the exact KLD (docs/serving.md: its bias)."""
    if local_logits.shape[0] == 0:
        return ShadowScore()
    local = torch.log_softmax(local_logits.float(), dim=-1)
    ids = torch.cat([top_ids, targets[:, None]], dim=-1)  # S: [N, k+1]
    upstream = torch.cat([top_logp, target_logp[:, None]], dim=-1)
    keep = torch.isfinite(upstream)
    keep[:, -1] &= ~(top_ids == targets[:, None]).any(-1)  # the target once
    log_p, log_q = (upstream, local.gather(-1, ids)) if upstream_is_full else (local.gather(-1, ids), upstream)
    p, q = torch.where(keep, log_p.exp(), 0.0), torch.where(keep, log_q.exp(), 0.0)
    terms = torch.where(keep, p * (log_p - log_q), 0.0).sum(-1)
    p_tail, q_tail = (1 - p.sum(-1)).clamp(min=0), (1 - q.sum(-1)).clamp(min=1e-12)
    tail = torch.where(p_tail > 1e-12, p_tail * (p_tail.clamp(min=1e-12).log() - q_tail.log()), 0.0)
    kld = (terms + tail).clamp(min=0)
    nll_local = -local.gather(-1, targets[:, None]).squeeze(-1)
    nll_full, nll_quant = (-target_logp, nll_local) if upstream_is_full else (nll_local, -target_logp)
    return ShadowScore(
        num_tokens=local.shape[0],
        kld_sum=kld.double().sum().item(),
        top1_matches=int((local.argmax(-1) == top_ids[:, 0]).sum().item()),
        nll_full_sum=nll_full.double().sum().item(),
        nll_quant_sum=nll_quant.double().sum().item(),
    )


def score_sequence(full_logits: torch.Tensor, quant_logits: torch.Tensor, token_ids, num_prompt_tokens: int):
    """Logits [T, V] over a whole sequence of T tokens -> the score of its output positions."""
    tokens = torch.as_tensor(token_ids, dtype=torch.long)
    rows = slice(num_prompt_tokens - 1, len(tokens) - 1)
    return score_rows(full_logits[rows], quant_logits[rows], tokens[num_prompt_tokens:])


def total(scores: Iterable[ShadowScore]) -> ShadowScore:
    result = ShadowScore()
    for score in scores:
        result = result + score
    return result


def gate_thresholds(kld: float | None, top1: float | None, ppl_increase: float | None) -> Thresholds:
    """A fallback threshold as the gate's: kld -> max_kld, top1 -> min_top1, ppl_increase -> max_ppl_increase."""
    return Thresholds(max_kld=kld, min_top1=top1, max_ppl_increase=ppl_increase)


def crossed(window: ShadowScore, thresholds: Thresholds) -> list[str]:
    """The thresholds the window's metrics cross, by the gate's own `check`: ["kld_mean 0.61 > 0.5"]."""
    failed = []
    for c in check(window.metrics(), thresholds):
        if not c.passed:
            op = ">" if c.name.startswith("max_") else "<"
            failed.append(f"{c.metric} {c.value:.4g} {op} {c.limit:g}")
    return failed
