"""Top-k routing of a mixture-of-experts block (vLLM's fused_topk): what the runtime's experts
(models/moe.py) and calibration's (quant/moe.py) both compute, so that calibration sees the
routing the served model makes."""

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert indices [T, k]): softmax over all
    experts in float32, the top k kept, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts
