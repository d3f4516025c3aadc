"""Token-level comparison of an artifact with its full-precision base. Pure tensor math.

For every predicted position t (the last position of a window predicts nothing):
  NLL_m(t) = -log p_m(x_{t+1} | x_≤t)                     perplexity = exp(mean NLL)
  KLD(t)   = Σ_v p_base(v) (log p_base(v) - log p_art(v))   KL(P_base ‖ P_art), in nats
  top1(t)  = [argmax p_art = argmax p_base]
"""

from dataclasses import dataclass, field

import torch


@dataclass
class TokenStats:
    """Per-token values accumulated over batches (1-D, one entry per predicted token)."""

    nll_base: list[torch.Tensor] = field(default_factory=list)
    nll_artifact: list[torch.Tensor] = field(default_factory=list)
    kld: list[torch.Tensor] = field(default_factory=list)
    top1_match: list[torch.Tensor] = field(default_factory=list)

    def add(self, base_logits: torch.Tensor, artifact_logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """base_logits, artifact_logits: [B, T, V]; tokens: [B, T]."""
        log_p = torch.log_softmax(base_logits[:, :-1].float(), dim=-1)
        log_q = torch.log_softmax(artifact_logits[:, :-1].float(), dim=-1)
        targets = tokens[:, 1:].unsqueeze(-1)
        self.nll_base.append(-log_p.gather(-1, targets).flatten())
        self.nll_artifact.append(-log_q.gather(-1, targets).flatten())
        self.kld.append((log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0).flatten())
        self.top1_match.append((log_p.argmax(-1) == log_q.argmax(-1)).flatten())


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
