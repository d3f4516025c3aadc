"""Token-level comparison of an artifact with its full-precision base. Pure tensor math.

For every predicted position t (the last position of a window predicts nothing):
  NLL_m(t) = -log p_m(x_{t+1} | x_≤t)                     perplexity = exp(mean NLL)
  KLD(t)   = Σ_v p_base(v) (log p_base(v) - log p_art(v))   KL(P_base ‖ P_art), in nats
  top1(t)  = [argmax p_art = argmax p_base]
With the reference cache, the gate keeps only the base's top-k log-probabilities per token (a
`Reference`), so its KLD is taken over the k most likely tokens plus one "tail" bucket for the rest:
  KLD_k(t) = Σ_{v ∈ top-k} p(v) log(p(v)/q(v)) + p_tail log(p_tail/q_tail),  p_tail = 1 − Σ_top-k p
It never exceeds the full KLD (merging outcomes cannot increase a divergence); how far below it
is on the reference models is in docs/results.md.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class Reference:
    """What the gate needs of the base model, per predicted token ([W, T-1, ...] for W windows)."""

    topk_ids: torch.Tensor  # int32 [W, T-1, k], most likely first
    topk_logp: torch.Tensor  # fp32 [W, T-1, k]
    target_nll: torch.Tensor  # fp32 [W, T-1]

    def __getitem__(self, index) -> "Reference":
        return Reference(self.topk_ids[index], self.topk_logp[index], self.target_nll[index])

    @staticmethod
    def cat(parts: list["Reference"]) -> "Reference":
        return Reference(*(torch.cat([getattr(p, f) for p in parts]) for f in ("topk_ids", "topk_logp", "target_nll")))


def reference_from_logits(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> Reference:
    """logits [B, T, V], tokens [B, T] -> the base's top-k log-probs and target NLL."""
    log_p = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    topk = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
    nll = -log_p.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return Reference(topk.indices.to(torch.int32), topk.values, nll)


def topk_kld(reference: Reference, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P ‖ Q) over the base's top-k plus a tail bucket: [..., V] log_q -> [...]."""
    return topk_kld_at(reference, log_q.gather(-1, reference.topk_ids.long()))


def topk_kld_at(reference: Reference, log_q_topk: torch.Tensor) -> torch.Tensor:
    """topk_kld from log Q at the base's top-k ids only ([..., k]): what an outside engine returns."""
    log_p = reference.topk_logp
    p = log_p.exp()
    p_tail = (1 - p.sum(-1)).clamp(min=0)
    q_tail = (1 - log_q_topk.exp().sum(-1)).clamp(min=1e-12)
    tail = torch.where(p_tail > 1e-12, p_tail * (torch.log(p_tail.clamp(min=1e-12)) - torch.log(q_tail)), 0.0)
    return ((p * (log_p - log_q_topk)).sum(-1) + tail).clamp(min=0)


@dataclass
class TokenStats:
    """Per-token values accumulated over batches (1-D, one entry per predicted token)."""

    nll_base: list[torch.Tensor] = field(default_factory=list)
    nll_artifact: list[torch.Tensor] = field(default_factory=list)
    kld: list[torch.Tensor] = field(default_factory=list)
    top1_match: list[torch.Tensor] = field(default_factory=list)
    window_tokens: list[int] = field(default_factory=list)  # predicted tokens of each window, in order

    def add(self, base_logits: torch.Tensor, artifact_logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Exact, full-vocabulary comparison. base_logits, artifact_logits [B, T, V]; tokens [B, T]."""
        log_p = torch.log_softmax(base_logits[:, :-1].float(), dim=-1)
        log_q = torch.log_softmax(artifact_logits[:, :-1].float(), dim=-1)
        nll_base = -log_p.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        self._append(nll_base, log_q, tokens, _kld(log_p, log_q), log_p.argmax(-1))

    def add_reference(self, reference: Reference, artifact_logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Comparison with the base's cached top-k (KLD over top-k plus tail)."""
        log_q = torch.log_softmax(artifact_logits[:, :-1].float(), dim=-1)
        self._append(reference.target_nll, log_q, tokens, topk_kld(reference, log_q), reference.topk_ids[..., 0])

    def add_gathered(
        self,
        reference: Reference,
        logp_at_ids: torch.Tensor,
        target_logp: torch.Tensor,
        argmax: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        """Comparison with the base's top-k from what an outside engine computed ([B, T-1] each, and
        [B, T-1, k] log Q at reference.topk_ids): the same numbers add_reference gives from full logits."""
        self.window_tokens.extend([target_logp.shape[-1]] * target_logp.shape[0])
        self.nll_base.append(reference.target_nll.flatten())
        self.nll_artifact.append(-target_logp.flatten())
        self.kld.append(topk_kld_at(reference, logp_at_ids).flatten())
        self.top1_match.append((reference.topk_ids[..., 0].long() == argmax.long()).flatten())

    def _append(
        self,
        nll_base: torch.Tensor,
        log_q: torch.Tensor,
        tokens: torch.Tensor,
        kld: torch.Tensor,
        base_top1: torch.Tensor,
    ) -> None:
        # every argument is [B, T-1]: one row per window
        self.window_tokens.extend([kld.shape[-1]] * kld.shape[0])
        self.nll_base.append(nll_base.flatten())
        self.nll_artifact.append(-log_q.gather(-1, tokens[:, 1:].unsqueeze(-1)).flatten())
        self.kld.append(kld.flatten())
        self.top1_match.append((base_top1.long() == log_q.argmax(-1)).flatten())


def _kld(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0)


def full_kld(base_logits: torch.Tensor, artifact_logits: torch.Tensor) -> torch.Tensor:
    """The exact KL(P_base ‖ P_art) over the whole vocabulary, per position: [B, T, V] -> [B, T]."""
    return _kld(torch.log_softmax(base_logits.float(), dim=-1), torch.log_softmax(artifact_logits.float(), dim=-1))


KLD_BIN_EDGES = [0.0] + [10.0 ** (e / 4) for e in range(-24, 5)]  # nats: 0, then 1e-6 to 10, 4 per decade


def kld_histogram(stats: TokenStats) -> dict:
    """How many tokens fall in each quarter decade of KL divergence (the report's histogram)."""
    kld = torch.cat(stats.kld).double()
    edges = torch.tensor(KLD_BIN_EDGES + [float("inf")], dtype=torch.float64)
    counts = torch.bucketize(kld, edges[1:-1], right=True).bincount(minlength=len(edges) - 1)
    return {"edges": KLD_BIN_EDGES, "counts": counts.tolist()}


@dataclass(frozen=True)
class WindowStats:
    """Per-window sums, [W] float64 each: the unit the gate's statistics resample (tokens inside a
    window are correlated, windows are close to independent). Every gate metric is a ratio of sums,
    so it is exact for any subset of windows: `window_metrics(stats.select(index))`."""

    tokens: torch.Tensor  # predicted tokens per window
    nll_base: torch.Tensor  # Σ NLL of the base
    nll_artifact: torch.Tensor  # Σ NLL of the artifact
    kld: torch.Tensor  # Σ KLD(t)
    top1: torch.Tensor  # Σ top1(t): positions whose top token is the base's

    def __len__(self) -> int:
        return self.tokens.numel()

    def select(self, index: torch.Tensor | list[int]) -> "WindowStats":
        """The windows at `index` (repeats allowed: a bootstrap resample)."""
        index = torch.as_tensor(index, dtype=torch.long)
        return WindowStats(*(getattr(self, f)[index] for f in ("tokens", "nll_base", "nll_artifact", "kld", "top1")))

    @staticmethod
    def of(stats: TokenStats) -> "WindowStats":
        sizes = stats.window_tokens
        if not sizes:
            raise ValueError("no windows were scored")

        def sums(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([w.double().sum() for w in torch.cat(parts).split(sizes)])

        return WindowStats(
            torch.tensor(sizes, dtype=torch.float64),
            sums(stats.nll_base),
            sums(stats.nll_artifact),
            sums(stats.kld),
            sums(stats.top1_match),
        )


def window_metrics(stats: WindowStats) -> dict[str, float]:
    """The gate's ratio metrics over these windows (sums over windows, then one ratio): the same
    numbers `summarize` gives for the same tokens, up to float rounding."""
    tokens = stats.tokens.sum()
    ppl_base = (stats.nll_base.sum() / tokens).exp()
    ppl_artifact = (stats.nll_artifact.sum() / tokens).exp()
    return {
        "ppl_increase_pct": (100.0 * (ppl_artifact / ppl_base - 1.0)).item(),
        "kld_mean": (stats.kld.sum() / tokens).item(),
        "top1_pct": (100.0 * stats.top1.sum() / tokens).item(),
    }


def summarize(stats: TokenStats) -> dict[str, float]:
    nll_base = torch.cat(stats.nll_base).double()
    nll_artifact = torch.cat(stats.nll_artifact).double()
    kld = torch.cat(stats.kld).double()
    ppl_base = nll_base.mean().exp().item()
    ppl_artifact = nll_artifact.mean().exp().item()
    quantiles = torch.quantile(kld, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64)).tolist()
    return {
        "num_tokens": kld.numel(),
        "ppl_base": ppl_base,
        "ppl_artifact": ppl_artifact,
        "ppl_increase_pct": 100.0 * (ppl_artifact / ppl_base - 1.0),
        "kld_mean": kld.mean().item(),
        "kld_median": quantiles[0],
        "kld_p95": quantiles[1],
        "kld_p99": quantiles[2],
        "kld_max": kld.max().item(),
        "top1_pct": 100.0 * torch.cat(stats.top1_match).double().mean().item(),
    }
