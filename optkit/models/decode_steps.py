"""Several decode steps of the runtime model in a row (CausalLM.decode_steps, for the runtime's
multi-step decoding: runtime/model_runner.py), each token chosen from the step before's logits. The
model's work around a step is paid once for all of them: the RoPE tables of every step are computed
in one call, and a 4-bit artifact's stack checks its weights and builds every step's arguments once
(models/fused_stack.py); where it can, the embedding, that stack, the final norm and the head run as
one call a step (models/fused_tail.py). Each step computes what `forward` and `compute_logits`
compute, the same bits.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models import fused_stack, fused_tail

if TYPE_CHECKING:
    from optkit.models.llama import CausalLM


def run(
    model: "CausalLM",
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metas: list[AttentionMetadata | list[AttentionMetadata]],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    choose: Callable[[torch.Tensor, int], torch.Tensor | None],
    fusable: Callable[[nn.Module], bool],
    own_forward: bool = False,
) -> None:
    """CausalLM.decode_steps (its arguments); `fusable(layer)`: whether the fused stack computes the
    layer; `own_forward`: the model's class has its own forward, which each step then calls."""
    num_steps, num_seqs = positions.shape
    if own_forward:
        for i in range(num_steps):
            input_ids = choose(model.compute_logits(model(input_ids, positions[i], metas[i], kv_caches)), i)
            if input_ids is None:
                return
        return
    layers = model.model.layers
    dtype = model.get_input_embeddings().weight.dtype
    all_tables, rope_index = model.rope_tables(positions.reshape(-1), dtype)  # [n·B, 1, R] each
    rows = [slice(i * num_seqs, (i + 1) * num_seqs) for i in range(num_steps)]
    tables = [[(cos[r], sin[r]) for cos, sin in all_tables] for r in rows]  # step i's: [B, 1, R] views
    layer_metas = [m if isinstance(m, list) else [m] * len(layers) for m in metas]
    stack, tail = None, None
    for i in range(num_steps):
        if i == 0:  # a 4-bit artifact on the CPU: every step's stack call prepared at once
            h = model.embed(input_ids)  # its rows and dtype choose the calls (the one call embeds again)
            stack = fused_stack.decode_steps(layers, fusable, h, tables, rope_index, layer_metas, kv_caches)
            tail = None if stack is None else fused_tail.tail(model, h, stack.stack)
        if tail is not None:  # the whole step in one call
            logits = stack.logits(input_ids, tail, i)
        else:
            h = h if i == 0 else model.embed(input_ids)
            if stack is not None:
                h = stack.run(h, i)
            else:
                rope = [tables[i][j] for j in rope_index]
                for layer, kv_cache, (cos, sin), meta in zip(layers, kv_caches, rope, layer_metas[i], strict=True):
                    h = layer(h, cos, sin, meta, kv_cache)
            logits = model.compute_logits(model.model.norm(h))
        input_ids = choose(logits, i)
        if input_ids is None:  # the steps left would change nothing
            return
