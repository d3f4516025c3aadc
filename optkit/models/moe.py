"""The runtime's mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks the top k
of E SwiGLU experts per token, their softmax weights renormalized as the family does
(kernels/moe_routing.py), and the block returns the weighted sum of the chosen experts' outputs (plus, in Qwen2-MoE,
a shared expert scaled by sigmoid(shared_expert_gate(x))).

Each expert's matrices are separate linears named as checkpoints and vLLM name them
(`experts.N.w1/w3/w2`, `experts.N.gate_proj/up_proj/down_proj`), so quantized artifacts swap them
one by one like any other linear. Two paths compute the same sum:
- reference: every expert on every token, weighted by a dense [T, E] matrix (zero where not chosen):
  E/k times the work, static shapes (what a CUDA graph can capture), the plain definition;
- grouped: the tokens sorted by expert, each expert run once on its own tokens.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from optkit.families import MoELayout
from optkit.kernels.moe_routing import route


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights divided by their sum
    sparse_layers: tuple[int, ...]  # the decoder layers with the MoE block (the rest: a dense MLP)
    expert_linears: tuple[str, str, str]  # (gate, up, down) names
    router: str = "gate"
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    shared_intermediate_size: int = 0


def moe_config(layout: MoELayout, config: dict) -> MoEConfig:
    """The MoE fields of config.json, as the family's layout (families/) reads them."""
    num_experts, top_k, inner = layout.dims(config)
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=inner,
        renormalize=layout.renormalize(config),
        sparse_layers=tuple(i for i in range(config["num_hidden_layers"]) if layout.is_sparse(config, i)),
        expert_linears=layout.expert_linears,
        router=layout.router,
        shared_expert=layout.shared_expert,
        shared_expert_gate=layout.shared_expert_gate,
        shared_intermediate_size=config[layout.shared_intermediate_key] if layout.shared_intermediate_key else 0,
    )


class Expert(nn.Module):
    """One SwiGLU expert, down(silu(gate(x)) · up(x)), its linears under the family's names."""

    def __init__(self, hidden: int, inner: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        for name, (inp, out) in zip(names, ((hidden, inner), (hidden, inner), (inner, hidden)), strict=True):
            self.add_module(name, nn.Linear(inp, out, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class SparseMoE(nn.Module):
    """x [T, hidden] -> [T, hidden]. `grouped` None chooses: grouped unless a CUDA graph is being
    captured (data-dependent shapes) or there are fewer tokens than experts (decode)."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.add_module(moe.router, nn.Linear(hidden_size, moe.num_experts, bias=False))
        self.experts = nn.ModuleList(
            Expert(hidden_size, moe.intermediate_size, moe.expert_linears) for _ in range(moe.num_experts)
        )
        if moe.shared_expert:
            names = ("gate_proj", "up_proj", "down_proj")
            self.add_module(moe.shared_expert, Expert(hidden_size, moe.shared_intermediate_size, names))
            self.add_module(moe.shared_expert_gate, nn.Linear(hidden_size, 1, bias=False))

    def forward(self, x: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        weights, chosen = route(getattr(self, self.moe.router)(x), self.moe.top_k, self.moe.renormalize)  # [T, k]
        if grouped is None:
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            grouped = not capturing and x.shape[0] >= self.moe.num_experts
        out = self._grouped(x, weights, chosen) if grouped else self._reference(x, weights, chosen)
        if self.moe.shared_expert:
            shared = getattr(self, self.moe.shared_expert)(x)
            out = out + torch.sigmoid(getattr(self, self.moe.shared_expert_gate)(x)) * shared
        return out

    def _reference(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(x.shape[0], self.moe.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, chosen, weights)  # [T, E]: the routing weight of each expert, 0 if not chosen
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for index, expert in enumerate(self.experts):
            out += expert(x).float() * dense[:, index, None]
        return out.to(x.dtype)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        top_k = self.moe.top_k
        order = chosen.flatten().argsort(stable=True)  # the T·k (token, slot) pairs sorted by expert
        counts = torch.bincount(chosen.flatten(), minlength=self.moe.num_experts).tolist()
        token = order // top_k  # [T·k]: which token each sorted pair belongs to
        pair_weights = weights.flatten()[order]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = token[start : start + count]
                y = expert(x[rows]).float() * pair_weights[start : start + count, None]
                out.index_add_(0, rows, y)
            start += count
        return out.to(x.dtype)
