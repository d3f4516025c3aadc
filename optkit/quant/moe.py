"""Mixture-of-experts blocks for calibration: each expert's matrices as separate `nn.Linear`s, named
as the checkpoints store them, so every method quantizes them as it does a dense model's linears.

transformers 5 fuses the experts into 3D parameters (`experts.gate_up_proj` [E, 2·I, H],
`experts.down_proj` [E, H, I]); calibration swaps each such block for `CalibrationMoE`, which loads
the per-expert checkpoint keys as they are and computes the same output. Two calibration modes:
- "all": every token goes through every expert, so each expert's Hessian and activation statistics
  see all the calibration data, each token weighted by how much the router sends it to that expert
  (`expert_token_weights`); the block's output still follows the router (only the chosen experts'
  outputs, weighted, are summed).
- "routed": each expert sees only the tokens the router sends it, all weighted alike.
"""

import torch
import torch.nn.functional as F
from torch import nn

from optkit.families import Family, MoELayout, expand_group, family_for
from optkit.kernels.moe_routing import route

MOE_CALIBRATION = ("all", "routed")
# what the manifest's calibration record says of each mode's token weights (expert_token_weights)
TOKEN_WEIGHTS = {
    "all": "every token, c_te = (p_te / sum of the top-k p_t)^2 (p: router softmax; without renormalization p_te^2)",
    "routed": "the routed tokens only, c_te = 1",
}


def expert_token_weights(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """router_logits [T, E] -> c [T, E] float32: how much token t counts in expert e's statistics.

    The block's output is y_t = Σ_{e ∈ top-k(t)} g_te · f_e(x_t), so an error Δf_e reaches it scaled
    by g_te, and GPTQ's objective for expert e is Σ_t g_te² ‖ΔW x_t‖² over its routed tokens. Every
    token keeps a share here, so that a rarely chosen expert still gets full-rank statistics: c_te =
    q_te², where q_te = p_te · r_t is the softmax probability p scaled as the router scales the
    chosen weights (r_t = 1 / Σ_{top-k} p_t when it renormalizes, else 1). For a routed token q_te is
    exactly its routing weight g_te; an unrouted one counts with the weight it would have had."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    if renormalize:
        probs = probs / torch.topk(probs, top_k, dim=-1).values.sum(dim=-1, keepdim=True)
    return probs.square()


def token_weight(layer: nn.Module, name: str) -> torch.Tensor | None:
    """During a forward in "all" mode: [T] the weight of each token of the current batch in the
    statistics of linear `name` (local to `layer`) when it belongs to a routed expert; else None."""
    parent = layer.get_submodule(name.rpartition(".")[0])
    return parent.token_weight if isinstance(parent, SwiGLUExpert) else None


class SwiGLUExpert(nn.Module):
    """down(silu(gate(x)) · up(x)), with the family's linear names.

    `token_weight` ([T] or None) is set by CalibrationMoE around each call in "all" mode, for
    the calibration hooks of the expert's linears to read (`token_weight()`)."""

    def __init__(self, hidden: int, inner: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        self.token_weight: torch.Tensor | None = None
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, inner, bias=False))
        self.add_module(up, nn.Linear(hidden, inner, bias=False))
        self.add_module(down, nn.Linear(inner, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class CalibrationMoE(nn.Module):
    """A sparse MoE block with per-expert linears; x [B, L, H] -> [B, L, H].

    `mode` is "all" or "routed" (module docstring). `routed_tokens[e]` counts the tokens the router
    sent to expert e since the last `routed_tokens.zero_()`."""

    def __init__(self, layout: MoELayout, config: dict, mode: str = "all"):
        super().__init__()
        hidden = config["hidden_size"]
        num_experts, self.top_k, inner = layout.dims(config)
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
        logits = getattr(self, self.router_name)(flat)  # [T, E]
        weights, chosen = route(logits, self.top_k, self.renormalize)
        statistics = expert_token_weights(logits, self.top_k, self.renormalize) if self.mode == "all" else None
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)  # the tokens routed to this expert, and where in their top k
            self.routed_tokens[index] += token.numel()
            if statistics is not None:
                # [B, L, H] as a dense MLP's input, so that every statistic sees every token
                expert.token_weight = statistics[:, index]
                y = expert(x).reshape(-1, x.shape[-1])[token]
                expert.token_weight = None
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


def calibration_record(model_type: str, mode: str) -> dict[str, str]:
    """The manifest's calibration record of a mixture of experts: the mode and its token weights
    (empty for a dense model)."""
    if family_for(model_type).moe is None:
        return {}
    return {"moe_calibration": mode, "moe_token_weights": TOKEN_WEIGHTS[mode]}


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
