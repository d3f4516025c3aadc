"""EAGLE's self-distillation loss (Li et al. 2024, section 4.2): regress the target's next feature
and match the target's next-token distribution through its frozen LM head."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FEATURE_WEIGHT = 1.0  # EAGLE's w_reg (smooth L1 on features)
DISTRIBUTION_WEIGHT = 0.1  # EAGLE's w_cls (cross-entropy against the target's distribution)


@dataclass
class DistillLoss:
    loss: torch.Tensor  # the weighted sum, for backward
    feature: float  # smooth L1 per element
    distribution: float  # cross-entropy per token, in nats
    top1: float  # share of tokens where the head's and the target's argmax agree


def head_inputs(
    embed: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a window's tokens [B, T] and target features [B, T, H]: the head's inputs at positions
    0..T-2 (embedding of token t+1, feature t), their position ids, and the labels (feature t+1)."""
    embeds = embed(tokens[:, 1:])
    positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    return embeds, features[:, :-1], positions


def distillation_loss(predicted: torch.Tensor, target: torch.Tensor, lm_head: torch.nn.Module) -> DistillLoss:
    """predicted, target: [B, T, H] features. The distribution term compares
    softmax(lm_head(target)) with log_softmax(lm_head(predicted)), as EAGLE's training loop."""
    with torch.no_grad():
        target_logits = lm_head(target).float()
        target_probs = target_logits.softmax(-1)
    log_probs = lm_head(predicted).float().log_softmax(-1)
    distribution = -(target_probs * log_probs).sum(-1).mean()
    feature = F.smooth_l1_loss(predicted.float(), target.float())
    top1 = (log_probs.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    loss = FEATURE_WEIGHT * feature + DISTRIBUTION_WEIGHT * distribution
    return DistillLoss(loss, feature.item(), distribution.item(), top1)


def chain_length_estimate(top1: float, k: int) -> float:
    """Mean accepted tokens + 1 per step of a k-token chain whose drafts each match with
    probability `top1` independently: (1 - a^(k+1)) / (1 - a)."""
    if top1 >= 1.0:
        return k + 1.0
    return (1 - top1 ** (k + 1)) / (1 - top1)
