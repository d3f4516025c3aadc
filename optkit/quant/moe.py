"""Mixture-of-experts blocks for calibration: each expert's matrices as separate `nn.Linear`s, named
as the checkpoints store them, so every method quantizes them as it does a dense model's linears.

transformers 5 fuses the experts into 3D parameters (`experts.gate_up_proj` [E, 2·I, H],
`experts.down_proj` [E, H, I]); calibration swaps each such block for `CalibrationMoE`, which loads
the per-expert checkpoint keys as they are and computes the same output. Two calibration modes:
- "all": every token goes through every expert, so each expert's Hessian and activation statistics
  see all the calibration data; the block's output still follows the router (only the chosen
  experts' outputs, weighted, are summed).
- "routed": each expert sees only the tokens the router sends it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from optkit.quant.families import Family, MoELayout, expand_group

MOE_CALIBRATION = ("all", "routed")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert indices [T, k]): softmax over all
    experts in float32, the top k kept, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SwiGLUExpert(nn.Module):
    """down(silu(gate(x)) · up(x)), with the family's linear names."""

    def __init__(self, hidden: int, inner: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, inner, bias=False))
        self.add_module(up, nn.Linear(hidden, inner, bias=False))
        self.add_module(down, nn.Linear(inner, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


def moe_dims(layout: MoELayout, config: dict) -> tuple[int, int, int]:
    """(number of experts, experts per token, expert intermediate size) from config.json."""
    return layout.num_experts(config), config["num_experts_per_tok"], config[layout.intermediate_key]


class CalibrationMoE(nn.Module):
    """A sparse MoE block with per-expert linears; x [B, L, H] -> [B, L, H].

    `mode` is "all" or "routed" (module docstring). `routed_tokens[e]` counts the tokens the router
    sent to expert e since the last `routed_tokens.zero_()`."""

    def __init__(self, layout: MoELayout, config: dict, mode: str = "all"):
        super().__init__()
        hidden = config["hidden_size"]
        num_experts, self.top_k, inner = moe_dims(layout, config)
        self.renormalize = layout.renormalize(config)
        self.mode = mode
        self.add_module(layout.router, nn.Linear(hidden, num_experts, bias=False))
        self.router_name = layout.router
        self.experts = nn.ModuleList(SwiGLUExpert(hidden, inner, layout.expert_linears) for _ in range(num_experts))
        self.shared_expert_name, self.shared_gate_name = layout.shared_expert, layout.shared_expert_gate
        if layout.shared_expert:
            shared = SwiGLUExpert(hidden, config[layout.shared_intermediate_key], ("gate_proj", "up_proj", "down_proj"))
            self.add_module(layout.shared_expert, shared)
            self.add_module(layout.shared_expert_gate, nn.Linear(hidden, 1, bias=False))
        self.register_buffer("routed_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [T, H], T = B·L
        weights, chosen = route(getattr(self, self.router_name)(flat), self.top_k, self.renormalize)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)  # the tokens routed to this expert, and where in their top k
            self.routed_tokens[index] += token.numel()
            if self.mode == "all":
                # [B, L, H] as a dense MLP's input, so that every statistic sees every token
                y = expert(x).reshape(-1, x.shape[-1])[token]
            elif token.numel():
                y = expert(flat[token])
            else:
                continue
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        if self.shared_expert_name:
            shared = getattr(self, self.shared_expert_name)(x).reshape(-1, x.shape[-1])
            out += torch.sigmoid(getattr(self, self.shared_gate_name)(flat)) * shared
        return out.reshape(x.shape)


def unfuse_experts(layers, family: Family, config: dict, mode: str = "all") -> None:
    """Swap each transformers MoE block of `layers` (decoder layers, any device) for a
    CalibrationMoE on the meta device (its weights come from the checkpoint)."""
    layout = family.moe
    for index, layer in enumerate(layers):
        if layout.is_sparse(config, index):
            with torch.device("meta"):
                setattr(layer, layout.block, CalibrationMoE(layout, config, mode))


def calibration_modules(layer: nn.Module) -> list[CalibrationMoE]:
    return [m for m in layer.modules() if isinstance(m, CalibrationMoE)]


def expert_min_tokens(layer: nn.Module, family: Family, targets: set[str], minimum: int | None) -> dict[str, int]:
    """Each targeted expert linear (local name) -> the fewest calibration tokens its statistics
    may come from: `minimum`, or 2 × its input width."""
    if family.moe is None:
        return {}
    experts = [n for n in expand_group(family.moe.expert_patterns, sorted(targets)) if n in targets]
    return {n: minimum or 2 * layer.get_submodule(n).in_features for n in experts}


def record_routed_tokens(layer: nn.Module, quantized: dict[str, tuple[object, dict]]) -> None:
    """stats["routed_tokens"] of each expert linear: the tokens the router sent its expert in the
    last pass over the calibration data (the quantized layer's, whose outputs feed the next layer)."""
    for block_name, block in layer.named_modules():
        if isinstance(block, CalibrationMoE):
            counts = block.routed_tokens.tolist()
            head = f"{block_name}.experts."
            for name, (_, stats) in quantized.items():
                if name.startswith(head):
                    stats["routed_tokens"] = counts[int(name[len(head) :].split(".")[0])]
