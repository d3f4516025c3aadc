"""Does llama.cpp compute, on a .gguf, what optkit's runtime computes on that file's own weights?

The strict line of the compatibility matrix's llama.cpp column (issues 33 and 34): at the positions
that predict tokens[:, first:], llama.cpp's top token equals the runtime's at ≥ 98% of them and its
perplexity lies within 1% of the runtime's. The runtime reads `reference_dir`, the file's weights
dequantized (gguf_read.write_model_dir, gguf_weights.read_weights), so the weights are the same on
both sides and what is measured is llama.cpp's graph and arithmetic (its 8-bit activations)."""

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from optkit.gate.llama_cpp import LlamaCppModel

SAME_TOP = 0.98  # the share of positions with the same top token
PPL_REL = 0.01  # |ppl_llama_cpp / ppl_runtime - 1|


@dataclass(frozen=True)
class Agreement:
    same_top: float
    ppl_llama_cpp: float
    ppl_runtime: float
    positions: int

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_llama_cpp / self.ppl_runtime

    @property
    def holds(self) -> bool:
        return self.same_top >= SAME_TOP and abs(self.ppl_ratio - 1) <= PPL_REL

    def describe(self) -> str:
        return (
            f"same top token at {self.same_top:.2%} of {self.positions} positions, "
            f"perplexity {self.ppl_llama_cpp:.4f} vs {self.ppl_runtime:.4f} ({self.ppl_ratio - 1:+.2%})"
        )


@torch.inference_mode()
def runtime_prefill_logits(reference_dir: Path, tokens: torch.Tensor, context_limit: int | None = None) -> torch.Tensor:
    """fp32 logits [B, T, V] of optkit's runtime on `reference_dir`, each row one prefill from an
    empty cache. context_limit: the context its RoPE is set for (LongRoPE picks its factors by it, as
    llama.cpp by its n_ctx); None: the model's own limit."""
    from optkit.kernels.paged_attention import AttentionMetadata
    from optkit.models.llama import allocate_kv_caches
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(reference_dir)
    if context_limit is not None:
        model.set_context_limit(context_limit)
    block_size, rows = 16, []
    dtype = model.get_input_embeddings().weight.dtype
    for row in tokens.tolist():
        blocks = math.ceil(len(row) / block_size)
        caches = allocate_kv_caches(model.config, blocks, block_size, dtype)
        meta = AttentionMetadata.build([len(row)], [len(row)], [list(range(blocks))], list(range(len(row))), "cpu")
        hidden = model(torch.tensor(row), torch.arange(len(row)), meta, caches)
        rows.append(model.compute_logits(hidden).float())
    return torch.stack(rows)


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean NLL) of `targets` [B, T] under `logits` [B, T, V]."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).exp().item()


def llama_cpp_agreement(
    path: Path, tokens: torch.Tensor, reference_dir: Path, n_ctx: int | None = None, first: int = 1
) -> Agreement:
    """llama.cpp on the .gguf at `path` (a context of n_ctx, default the rows' length) against the
    runtime on `reference_dir` with its RoPE set for the same context, on `tokens` [B, T]."""
    n_ctx = n_ctx or tokens.shape[1]
    llama = LlamaCppModel(path, n_ctx=n_ctx)
    try:
        got = llama(tokens).logits[:, first - 1 : -1]
    finally:
        llama.close()
    want = runtime_prefill_logits(reference_dir, tokens, n_ctx)[:, first - 1 : -1]
    targets = tokens[:, first:]
    same_top = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    return Agreement(same_top, perplexity(got, targets), perplexity(want, targets), targets.numel())
