"""EAGLE-3's training (Li et al. 2025, section 3; SafeAILab/EAGLE's traineagle3): the draft vocabulary,
the target's fused features, and the training-time-test loss: no feature regression, cross-entropy
against the target's next-token distribution restricted to the draft vocabulary at every unrolled step.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from optkit.speculative.eagle3_model import Eagle3HeadModel

STEP_WEIGHT = 0.8  # step i's loss weighs 0.8^i (traineagle3's ploss_weight)


@dataclass
class TTTLoss:
    loss: torch.Tensor  # the weighted sum over steps, for backward
    distribution: float  # step 0's cross-entropy per token, in nats
    top1: list[float]  # per unrolled step: share of rows whose draft token is the target's argmax


def draft_vocabulary(windows: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of `windows` (ties: the smaller id), ascending [size]."""
    counts = torch.bincount(windows.flatten(), minlength=vocab_size)[:vocab_size].long()
    order = torch.argsort(-counts * vocab_size + torch.arange(vocab_size), stable=True)  # count desc, then id
    return order[:size].sort().values


def residual_streams(
    target: nn.Module, tokens: torch.Tensor, layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's residual streams entering `layers` (each layer's input, as the runtime's
    CausalLM.forward aux_layers), concatenated [B, T, 3H], and its last hidden state after the final
    norm [B, T, H] (for its logits)."""
    decoder = target.get_decoder()
    seen: dict[int, torch.Tensor] = {}

    def hook(index):
        def capture(module, args, kwargs):
            seen[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return capture

    handles = [decoder.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in set(layers)]
    try:
        last = decoder(tokens).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([seen[i] for i in layers], dim=-1).float(), last.float()


def ttt_loss(
    head: Eagle3HeadModel,
    embed: Callable[[torch.Tensor], torch.Tensor],
    lm_head: nn.Module,
    tokens: torch.Tensor,
    fused_features: torch.Tensor,
    last_hidden: torch.Tensor,
    steps: int,
) -> TTTLoss:
    """tokens [B, T]; fused_features [B, T, 3H] and last_hidden [B, T, H], the target's. Rows r =
    0..T-2; step i's row r reads token x_{r+i+1} and is scored against the target's distribution
    after x_{r+i+1} (position r+i+1), where that position exists and the target's argmax is in the
    draft vocabulary (traineagle3's position mask)."""
    rows = tokens.shape[1] - 1
    with torch.no_grad():
        target_logits = lm_head(last_hidden).float()  # [B, T, V]
        draft_ids = head.draft_ids
        in_draft = torch.zeros(target_logits.shape[-1], dtype=torch.bool, device=tokens.device)
        in_draft[draft_ids] = True
        argmax = target_logits.argmax(-1)  # [B, T]
        probs = target_logits[..., draft_ids].softmax(-1)  # [B, T, N]
        embeds = []
        for i in range(steps):  # step i reads x_{r+i+1}; rows past the end read the last token, masked
            index = (torch.arange(rows, device=tokens.device) + i + 1).clamp(max=rows)
            embeds.append(embed(tokens[:, index]).float())
    outputs = head.training_time_test(embeds, head.fc(fused_features[:, :-1]), steps)
    total, top1, first = 0.0, [], 0.0
    for i, hidden in enumerate(outputs):
        label = (torch.arange(rows, device=tokens.device) + i + 1).clamp(max=rows)
        valid = (torch.arange(rows, device=tokens.device) + i + 1 <= rows)[None] & in_draft[argmax[:, label]]
        log_probs = head.logits(hidden).float().log_softmax(-1)  # [B, rows, N]
        cross = -(probs[:, label] * log_probs).sum(-1)  # [B, rows]
        loss = (cross * valid).sum() / valid.sum().clamp(min=1)
        total = total + STEP_WEIGHT**i * loss
        agree = draft_ids[log_probs.argmax(-1)] == argmax[:, label]  # [B, rows]
        reach = (torch.arange(rows, device=tokens.device) + i + 1 <= rows)[None].expand_as(agree)
        top1.append(float(agree[reach].float().mean()))
        if i == 0:
            first = loss.item()
    return TTTLoss(total, first, top1)


def ttt_chain_estimate(top1: list[float], k: int) -> float:
    """Mean accepted tokens + 1 per step of a k-token chain whose draft j is right with probability
    top1[j] (the last step's beyond the unrolled ones), given all before it were: 1 + Σ_j Π_{i<=j}."""
    expected, alive = 1.0, 1.0
    for j in range(k):
        alive *= top1[min(j, len(top1) - 1)]
        expected += alive
    return expected
