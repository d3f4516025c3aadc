"""The runtime model as the gate's language model: each window one prefill through paged attention,
so the gate measures what serving computes, KV cache included (`optkit eval --kv-cache-dtype int8`).
The prefill writes every key and value to the cache first and attends to them from there, so an
8-bit cache's rounding reaches every position, as it does for served tokens."""

import math
from types import SimpleNamespace

import torch

from optkit.kernels import kv_cache
from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models.llama import CausalLM, kv_cache_shape


class PagedLM:
    """model(input_ids [B, S]) -> .logits [B, S, vocab] float32, like a transformers causal LM."""

    def __init__(self, model: CausalLM, kv_cache_dtype: str = "auto", block_size: int = 16):
        self.model, self.kv_cache_dtype, self.block_size = model, kv_cache_dtype, block_size
        self.dtype = model.get_input_embeddings().weight.dtype

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=torch.stack([self._prefill(row) for row in input_ids]))

    def _prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        n = len(tokens)
        blocks = math.ceil(n / self.block_size)
        shape = kv_cache_shape(self.model.config, blocks, self.block_size)
        device = self.model.get_input_embeddings().weight.device
        caches = kv_cache.allocate(self.model.config.num_hidden_layers, shape, self.kv_cache_dtype, self.dtype, device)
        meta = AttentionMetadata.build([n], [n], [list(range(blocks))], list(range(n)), device)
        hidden = self.model(tokens.to(device), torch.arange(n, device=device), meta, caches)
        return self.model.compute_logits(hidden).float()
