"""Random steps over a paged KV cache for the attention tests: caches of random keys and values,
block tables shuffled, and the step's new K and V written where the runtime writes them; and the
reference every attention path is checked against."""

import math

import torch

from optkit.kernels.paged_attention import AttentionMetadata


def random_step(query_lens, context_lens, block_size, heads=(8, 2), dim=16, dtype=torch.float32, device="cpu", seed=0):
    """Caches of random keys with shuffled block tables, and this step's q/k/v written at the slots
    of positions context_len - query_len .. context_len - 1."""
    gen = torch.Generator().manual_seed(seed)
    q_heads, kv_heads = heads
    needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(needed) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    slots = [
        table[t // block_size] * block_size + t % block_size
        for table, q_len, c_len in zip(tables, query_lens, context_lens, strict=True)
        for t in range(c_len - q_len, c_len)
    ]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, slots, device)
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) for _ in range(2))
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, q_heads, dim, generator=gen)
    k, v = (torch.randn(num_tokens, kv_heads, dim, generator=gen) for _ in range(2))
    q, k, v, k_cache, v_cache = (t.to(device=device, dtype=dtype) for t in (q, k, v, k_cache, v_cache))
    torch_write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


def torch_write_kv(k, v, k_cache, v_cache, slots):
    """The PyTorch path of write_kv, which on CUDA would itself dispatch to Triton."""
    for new, cache in ((k, k_cache), (v, v_cache)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new.to(cache.dtype))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """optkit.kernels.paged_attention.paged_attention one token at a time, slot by slot, with an
    explicit softmax in float64 (a window: only the keys inside it)."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    tables = meta.block_tables.tolist()
    for b, (query_len, context_len) in enumerate(zip(meta.query_lens, meta.context_lens_list, strict=True)):
        for i in range(query_len):
            position = context_len - query_len + i
            first = 0 if window is None else max(0, position - window + 1)
            slots = [tables[b][t // block_size] * block_size + t % block_size for t in range(first, position + 1)]
            k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [p + 1, Hq, D]
            v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,thd->ht", q[starts[b] + i].double(), k) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[starts[b] + i] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
