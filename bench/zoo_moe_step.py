"""Training-step time of the `small-moe` reference model against `small`'s, measured in one run.

Each round times one optimizer step (batch 16 x 256 tokens, bf16 autocast, as optkit/zoo/train.py
trains) of every variant in turn, so a load change on shared cores hits all of them alike; the
table gives each variant's median seconds per step and the median of its per-round ratio to
`small`. Variants: `small` (Llama), and small-moe's Mixtral under transformers' experts
implementations (`grouped_mm`, the default; `eager`) and under `dense` (below: every expert on
every token, weighted by a dense [T, E] matrix of the router's top-k weights, zeros elsewhere).

    .venv/bin/python bench/zoo_moe_step.py --rounds 5
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

from optkit.zoo.specs import SPECS  # noqa: E402
from optkit.zoo.train import new_model  # noqa: E402


def dense_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """y_t = sum_e w[t, e] down_e(silu(gate_e x_t) * up_e x_t), w[t, e] = 0 unless e is in top-k(t):
    the sparse sum exactly, at E/k times the expert FLOPs, in two batched matmuls under autocast."""
    # hidden_states [T, H]; top_k_index, top_k_weights [T, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]
    dense = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=top_k_weights.dtype)
    dense = dense.scatter(1, top_k_index, top_k_weights)  # [T, E], differentiable in the router's weights
    gate, up = torch.matmul(hidden_states, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I]
    down = torch.matmul(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, H]
    return torch.einsum("eth,te->th", down.float(), dense.float()).to(hidden_states.dtype)


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["small", "grouped_mm", "dense", "eager"])
    args = parser.parse_args()
    torch.manual_seed(0)
    ALL_EXPERTS_FUNCTIONS.register("dense", dense_experts_forward)
    batch = torch.randint(0, 4096, (SPECS["small"].batch_size, SPECS["small"].seq_len))
    models = {}
    for variant in args.variants:
        if variant == "small":
            model = new_model(SPECS["small"], 4096, 0)
        else:
            model = new_model(SPECS["small-moe"], 4096, 0, experts_implementation=variant)
        model.train()
        models[variant] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        one_step(*models[variant], batch)  # warm-up
    times: dict[str, list[float]] = {v: [] for v in models}
    for _ in range(args.rounds):
        for variant, (model, optimizer) in models.items():
            times[variant].append(one_step(model, optimizer, batch))
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'variant':<12} {'s/step':>8} {'vs small':>9} {'parameters':>11}")
    for variant, ts in times.items():
        ratio = statistics.median(t / s for t, s in zip(ts, times["small"], strict=True)) if "small" in times else 0
        params = sum(p.numel() for p in models[variant][0].parameters())
        print(f"{variant:<12} {statistics.median(ts):8.3f} {ratio:9.2f} {params:11,}")


if __name__ == "__main__":
    main()
