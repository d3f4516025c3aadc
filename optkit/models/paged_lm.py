"""The runtime model as the gate's language model: each window through paged attention, so the gate
measures what serving computes, KV cache included (`optkit eval --kv-cache-dtype int8`).
By default each window is one prefill, which writes every key and value to the cache first and
attends to them from there, so an 8-bit cache's rounding reaches every position, as it does for
served tokens. With `chunk_size` c the windows of a batch run together c tokens at a time, as
chunked prefill (c > 1) or decode (c = 1) does: the cache is written c rows per block at a time, so
an 8-bit cache's per-block scale grows and requantizes the rows already stored (kernels/kv_cache.py)
as it does while serving, and each token reads the cache as it stood at its step."""

import math
from types import SimpleNamespace

import torch

from optkit.kernels import kv_cache
from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models.llama import CausalLM, kv_cache_shape


class PagedLM:
    """model(input_ids [B, S]) -> .logits [B, S, vocab] float32, like a transformers causal LM."""

    def __init__(
        self, model: CausalLM, kv_cache_dtype: str = "auto", block_size: int = 16, chunk_size: int | None = None
    ):
        assert chunk_size is None or chunk_size >= 1, chunk_size
        self.model, self.kv_cache_dtype, self.block_size = model, kv_cache_dtype, block_size
        self.chunk_size = chunk_size
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = model.get_input_embeddings().weight.device
        for module in model.modules():  # packed-integer layers: dequantized once for the run, not per window and layer
            if hasattr(module, "keep_dequantized"):
                module.keep_dequantized(self.dtype)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        if self.chunk_size is not None:
            return SimpleNamespace(logits=self._chunked(input_ids))
        return SimpleNamespace(logits=torch.stack([self._prefill(row) for row in input_ids]))

    def _caches(self, num_blocks: int) -> list[tuple]:
        shape = kv_cache_shape(self.model.config, num_blocks, self.block_size)
        return kv_cache.allocate(
            self.model.config.num_hidden_layers, shape, self.kv_cache_dtype, self.dtype, self.device
        )

    def _prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        n = len(tokens)
        blocks = math.ceil(n / self.block_size)
        meta = AttentionMetadata.build([n], [n], [list(range(blocks))], list(range(n)), self.device)
        hidden = self.model(tokens.to(self.device), torch.arange(n, device=self.device), meta, self._caches(blocks))
        return self.model.compute_logits(hidden).float()

    def _chunked(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S]: step i runs tokens [i·c, (i+1)·c) of every row, row b in blocks
        b·nb .. (b+1)·nb - 1 of one shared cache."""
        rows, n = input_ids.shape
        bs, nb = self.block_size, math.ceil(n / self.block_size)
        caches = self._caches(rows * nb)
        tables = [list(range(b * nb, (b + 1) * nb)) for b in range(rows)]
        logits = []
        for start in range(0, n, self.chunk_size):
            end = min(n, start + self.chunk_size)
            slots = [table[p // bs] * bs + p % bs for table in tables for p in range(start, end)]
            meta = AttentionMetadata.build([end - start] * rows, [end] * rows, tables, slots, self.device)
            ids = input_ids[:, start:end].reshape(-1).to(self.device)
            positions = torch.arange(start, end, device=self.device).repeat(rows)
            hidden = self.model(ids, positions, meta, caches)  # [rows · (end - start), hidden]
            logits.append(self.model.compute_logits(hidden).float().view(rows, end - start, -1))
        return torch.cat(logits, dim=1)
