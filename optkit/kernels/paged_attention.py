"""Attention over a paged KV cache, for a packed batch of prefill chunks and decodes.

Layouts (docs/runtime.md): per layer, k_cache and v_cache are [num_blocks, block_size, Hkv, D];
token t of a sequence sits in slot block_table[t // block_size] * block_size + t % block_size.
A step's T new tokens of B sequences are packed without padding; sequence b's are the rows
query_start_loc[b]:query_start_loc[b + 1] of q. A new token at position p attends to positions
0..p of its own sequence, where the last new token is at position context_lens[b] - 1.

`paged_attention` batches every decode (query_len 1) into one gather and one masked SDPA (on the CPU:
one call of the C++ decode kernel, no gather), does the same for each group of short chunks of one
length (speculative decoding's verification: 1 + k tokens per sequence; on the CPU each of their
rows is one decode of the keys it sees, through the same C++ kernel, so a verified position gets
plain decoding's bits), and runs one causal SDPA per longer chunk (the tests' reference, which loops
over every token, is in tests/kernels/paged_steps.py).
A sliding `window` W (Mistral, Gemma's local layers) hides the keys more than W - 1 positions before
the query (query p sees keys p - W + 1 .. p, as transformers' sliding_window_overlay); `softcap` c
(Gemma 2) replaces each score s by c·tanh(s / c) before the mask and softmax, so SDPA gives way to
an explicit softmax in float32 there, as in transformers' eager attention.
On CUDA, `write_kv` and `paged_attention` run the Triton kernels of optkit/kernels/triton when
triton imports and the layout suits them (optkit.kernels.triton.use_triton); the code below is the
path everywhere else.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from optkit.kernels import cpu_decode
from optkit.kernels import triton as triton_kernels  # imports triton only once a CUDA tensor asks
from optkit.kernels.attention_plan import GROUPED_MAX_QUERY, DecodeGroup, Plan, ShortGroup
from optkit.kernels.kv_cache import QuantizedKVCache


@dataclass
class AttentionMetadata:
    """What attention needs to know about a step of T tokens from B sequences."""

    slot_mapping: torch.Tensor  # int64 [T]: the cache slot each new token's K and V are written to
    query_start_loc: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]: tokens of b in the cache once this step's are written
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    query_lens: list[int]
    context_lens_list: list[int]
    max_query_len: int
    max_context_len: int
    # per block size: the step's split into decodes and chunks, shared by every layer
    _plans: dict[int, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        assert len(query_lens) == len(context_lens) == len(block_tables)
        assert sum(query_lens) == len(slot_mapping)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
            query_lens=list(query_lens),
            context_lens_list=list(context_lens),
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
        )

    def plan(self, block_size: int) -> Plan:
        if block_size not in self._plans:
            self._plans[block_size] = self._make_plan(block_size)
        return self._plans[block_size]

    def _make_plan(self, block_size: int) -> Plan:
        num_seqs = len(self.query_lens)
        if self.max_query_len == 1 and len(self.slot_mapping) == num_seqs > 0:  # every sequence one decode
            num_blocks = math.ceil(self.max_context_len / block_size)  # as below, without its lists
            tables, lens = self.block_tables[:, :num_blocks].long(), self.context_lens.long()
            return Plan(
                DecodeGroup(rows=slice(0, num_seqs), block_tables=tables, lens=lens, block_size=block_size), [], []
            )
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        decodes = [b for b, n in enumerate(self.query_lens) if n == 1]
        chunks = [(b, starts[b], n) for b, n in enumerate(self.query_lens) if n > GROUPED_MAX_QUERY]
        short = self._short_groups(starts, block_size)
        if not decodes:
            return Plan(None, chunks, short)
        device = self.block_tables.device
        rows = [starts[b] for b in decodes]
        lens = [self.context_lens_list[b] for b in decodes]
        num_blocks = math.ceil(max(lens) / block_size)
        if len(decodes) == len(self.query_lens):  # every sequence decodes (rows 0..B-1): no gather
            tables, lens_tensor = self.block_tables[:, :num_blocks].long(), self.context_lens.long()
        else:
            index = torch.tensor(decodes, dtype=torch.long, device=device)
            tables, lens_tensor = self.block_tables[index, :num_blocks].long(), torch.tensor(lens, device=device)
        group = DecodeGroup(
            rows=slice(0, len(rows)) if rows == list(range(len(rows))) else torch.tensor(rows, device=device),
            block_tables=tables,
            lens=lens_tensor,
            block_size=block_size,
        )
        return Plan(group, chunks, short)

    def _short_groups(self, starts: list[int], block_size: int) -> list[ShortGroup]:
        by_length: dict[int, list[int]] = {}
        for b, n in enumerate(self.query_lens):
            if 1 < n <= GROUPED_MAX_QUERY:
                by_length.setdefault(n, []).append(b)
        device = self.block_tables.device
        groups = []
        for query_len, members in by_length.items():
            lens = torch.tensor([self.context_lens_list[b] for b in members], device=device)
            num_blocks = math.ceil(max(self.context_lens_list[b] for b in members) / block_size)
            offsets = torch.arange(query_len, device=device)
            rows = torch.tensor([starts[b] for b in members], device=device)[:, None] + offsets  # [Bs, Lq]
            limits = lens[:, None] - query_len + 1 + offsets  # [Bs, Lq]: keys each query sees
            key_mask = torch.arange(num_blocks * block_size, device=device) < limits[:, :, None]  # [Bs, Lq, L]
            index = torch.tensor(members, dtype=torch.long, device=device)
            tables = self.block_tables[index, :num_blocks].long()
            groups.append(ShortGroup(rows, tables, key_mask[:, None], limits))
        return groups


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's keys and values. k, v: [T, Hkv, D]; caches [N, block_size, Hkv, D] (tensors, or
    8-bit caches that quantize what they store: optkit/kernels/kv_cache.py)."""
    if isinstance(k_cache, QuantizedKVCache):
        k_cache.write(k, slot_mapping)
        v_cache.write(v, slot_mapping)
        return
    heads, dim = k_cache.shape[2:]
    assert k.shape == v.shape == (slot_mapping.shape[0], heads, dim), (k.shape, k_cache.shape)
    same_device = k.device == v.device == k_cache.device == v_cache.device == slot_mapping.device
    if triton_kernels.use_triton(k_cache) and same_device and k_cache.is_contiguous() and v_cache.is_contiguous():
        from optkit.kernels.triton import paged_attention as kernels

        return kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; Hq a multiple of the cache's Hkv (grouped-query attention)."""
    num_tokens, q_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == dim, (q.shape, k_cache.shape)
    assert q_heads % kv_heads == 0 and num_tokens == meta.slot_mapping.shape[0], (q.shape, k_cache.shape)
    if triton_kernels.use_triton(q):
        from optkit.kernels.triton import paged_attention as kernels

        if kernels.unsupported_reason(q, k_cache, v_cache, meta) is None:
            return kernels.paged_attention(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    plan = meta.plan(block_size)
    decode_only = plan.decode is not None and not plan.short and not plan.chunks
    if decode_only and isinstance(plan.decode.rows, slice) and plan.decode.rows.stop == num_tokens:
        # every row a decode, in order: the group's output is the whole output
        return _decode_attention(q, k_cache, v_cache, plan.decode, scale, window, softcap)
    out = torch.empty_like(q)
    if plan.decode is not None:
        decode = _decode_attention(q[plan.decode.rows], k_cache, v_cache, plan.decode, scale, window, softcap)
        out[plan.decode.rows] = decode
    for group in plan.short:
        rows = group.rows.flatten()
        out[rows] = _short_attention(q[rows], k_cache, v_cache, group, scale, window, softcap)
    for b, start, query_len in plan.chunks:
        context_len = meta.context_lens_list[b]
        # with a window, only the keys some query of the chunk sees: from context_len - Lq - W + 1
        first = 0 if window is None else max(0, context_len - query_len - window + 1) // block_size * block_size
        table = meta.block_tables[b, first // block_size : math.ceil(context_len / block_size)].long()
        k = k_cache.index_select(0, table).flatten(0, 1)[: context_len - first]  # [S, Hkv, D]: first..context_len-1
        v = v_cache.index_select(0, table).flatten(0, 1)[: context_len - first]
        out[start : start + query_len] = _chunk_attention(q[start : start + query_len], k, v, scale, window, softcap)
    return out


def fused_decode_attention(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    *,
    num_heads: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> cpu_decode.DecodeAttention | None:
    """A decode-only step's attention as the C++ calls take it straight from a fused projection of
    activations like `x` [T, ...] (kernels/cpu_decode.py: decode_attention_qkv, decode_layer_w4a8):
    every row a decode, in order; the caches plain, contiguous and of x's dtype; no soft-cap. None
    where they cannot: the model then runs the steps one by one, which give the same bits."""
    k_cache, v_cache = kv_cache
    if softcap is not None or isinstance(k_cache, QuantizedKVCache) or not cpu_decode.enabled(x):
        return None
    same = k_cache.dtype == v_cache.dtype == cos.dtype == sin.dtype == x.dtype
    if not (
        same and k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    ):
        return None
    tables = decode_tables(meta, k_cache.shape[1], x.shape[0])
    if tables is None:
        return None
    return cpu_decode.DecodeAttention(num_heads, cos, sin, k_cache, v_cache, *tables, scale, window)


def decode_tables(
    meta: AttentionMetadata, block_size: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A step of `num_rows` tokens as the C++ decode calls take it: (slot_mapping, block tables long
    [B, nb], lens long [B]) where every row is a decode, in order; None otherwise."""
    plan = meta.plan(block_size)
    decode = plan.decode
    if decode is None or plan.short or plan.chunks or not isinstance(decode.rows, slice):
        return None
    return None if decode.rows.stop != num_rows else (meta.slot_mapping, decode.block_tables, decode.lens)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
) -> torch.Tensor:
    """SDPA over [..., Lq, D] queries and [..., S, D] keys (mask: bool, True = attend), or with
    `softcap` transformers' eager attention: scores capped, masked, softmax in float32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [N, block_size, Hkv, D], block_tables long [B, nb] -> [B, nb, block_size, Hkv, D].
    index_select copies whole blocks, much faster than advanced indexing (cache[block_tables]) on
    the CPU, where that gather was the largest non-matmul cost of a decode step (docs/results.md)."""
    blocks = cache.index_select(0, block_tables.reshape(-1))
    return blocks.view(*block_tables.shape, *cache.shape[1:])


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [Bd, Hq, D], one token per sequence -> [Bd, Hq, D]."""
    if _cpu_decode_takes(q, k_cache, v_cache, softcap):  # read through the table: no gather, no mask
        return cpu_decode.decode_attention(q, k_cache, v_cache, group.block_tables, group.lens, scale, window)
    batch, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    k = _gather_blocks(k_cache, group.block_tables).flatten(1, 2).transpose(1, 2)  # [Bd, Hkv, L, D]
    v = _gather_blocks(v_cache, group.block_tables).flatten(1, 2).transpose(1, 2)
    # The Hq / Hkv query heads that share a KV head become that head's "queries": one token has
    # no causal structure, so no repeat of K and V is needed.
    q = q.view(batch, kv_heads, q_heads // kv_heads, dim)  # [Bd, Hkv, G, D]
    out = _sdpa(q, k, v, group.mask(window), scale, softcap)
    return out.reshape(batch, q_heads, dim)


def _cpu_decode_takes(q: torch.Tensor, k_cache, v_cache, softcap: float | None) -> bool:
    """Whether cpu_decode.decode_attention takes these queries and caches: on the CPU, plain contiguous
    caches of q's dtype (same shapes: paged_attention asserts it), no soft-cap."""
    if softcap is not None or isinstance(k_cache, QuantizedKVCache) or not cpu_decode.enabled(q):
        return False
    return k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype == q.dtype


def _short_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: ShortGroup,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [Bs * Lq, Hq, D], Lq tokens per sequence -> [Bs * Lq, Hq, D]. Where the C++ decode attention
    takes the caches, each query row is one decode of the keys it sees, through that kernel: so a
    verification step's rows get the bits plain decoding gives those positions, one step each (greedy
    speculation then emits plain decoding's tokens, in bfloat16 too: docs/runtime.md)."""
    if _cpu_decode_takes(q, k_cache, v_cache, softcap):
        tables = group.block_tables.repeat_interleave(group.rows.shape[1], dim=0)  # [Bs * Lq, nb]
        return cpu_decode.decode_attention(q, k_cache, v_cache, tables, group.visible.flatten(), scale, window)
    batch, query_len = group.rows.shape
    q_heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    heads_per_kv = q_heads // kv_heads
    k = _gather_blocks(k_cache, group.block_tables).flatten(1, 2).transpose(1, 2)  # [Bs, Hkv, L, D]
    v = _gather_blocks(v_cache, group.block_tables).flatten(1, 2).transpose(1, 2)
    # As for decodes, the query heads sharing a KV head become rows of that head: (token i, head g).
    q = q.view(batch, query_len, kv_heads, heads_per_kv, dim).transpose(1, 2)  # [Bs, Hkv, Lq, G, D]
    q = q.reshape(batch, kv_heads, query_len * heads_per_kv, dim)
    out = _sdpa(q, k, v, group.mask_for(heads_per_kv, window), scale, softcap)
    out = out.view(batch, kv_heads, query_len, heads_per_kv, dim).transpose(1, 2)  # [Bs, Lq, Hkv, G, D]
    return out.reshape(batch * query_len, q_heads, dim)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The last Lq tokens of a sequence whose last S keys are given (all of them, or those of its
    window). q [Lq, Hq, D]; k, v [S, Hkv, D]."""
    query_len, context_len = q.shape[0], k.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    if query_len == context_len and window is None and softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at key index S - Lq + i and sees keys S - Lq + i - W + 1 .. S - Lq + i
        ones = torch.ones(query_len, context_len, dtype=torch.bool, device=q.device)
        mask = ones.tril(diagonal=context_len - query_len)
        if window is not None:
            mask &= ones.triu(diagonal=context_len - query_len - window + 1)
        if softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            group = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            out = _sdpa(q, k, v, mask, scale, softcap)
    return out.transpose(0, 1)
