"""Random steps over a paged KV cache for the attention tests: caches of random keys and values,
block tables shuffled, and the step's new K and V written where the runtime writes them."""

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
