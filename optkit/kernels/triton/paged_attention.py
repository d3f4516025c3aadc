"""Triton kernels for attention over the paged KV cache: the cache write, decode, and prefill.

Same semantics and layouts as `optkit.kernels.paged_attention` (its docstring and docs/runtime.md):
caches [num_blocks, block_size, Hkv, D]; token t of sequence b in slot
block_tables[b, t // block_size] * block_size + t % block_size; the Lq new tokens of b are rows
query_start_loc[b]:query_start_loc[b + 1] of q and sit at positions context_len - Lq .. context_len - 1.

- `write_kv`: one program per new token copies its [Hkv, D] row of k and v into its slot.
- decode (every query_len is 1): one program per (sequence, KV head, split of the context). The
  G = Hq / Hkv query heads sharing the KV head are the rows of one tl.dot, so each K/V tile is read
  once per group. With few programs for the SMs, the context is split (flash-decoding) and a second
  kernel merges the splits' partial softmax states.
- prefill (any mix of query lengths): one program per (tile of new tokens of one sequence, KV head),
  rows = BLOCK_Q tokens × G heads, found from query_start_loc by binary search on the device (no
  host-built index, nothing to sync). Flash-attention-2 over the cached prefix and the causal part.

A sliding window W (WINDOW > 0) hides keys at or before a row's position − W and starts each walk at
the window's first tile; a tile may then hold no key of some row, so its softmax state stays
(m = −inf, denom = 0) rather than turning NaN. A soft-cap c (SOFTCAP > 0) replaces each score s by
c·tanh(s / c), with tanh(x) = 1 − 2 / (e^{2x} + 1).

Every program walks the sequence's keys in tiles of BLOCK_N tokens with an online softmax in base 2
(scores pre-multiplied by log2 e), looking each token's block up in the block table, so any
cache block size works. All lengths are read on the device: a captured CUDA graph stays correct
when contexts grow; host values only pick grid sizes and the number of splits.
"""

import math

import torch
import triton
import triton.language as tl

from optkit.kernels.triton import _interpreter, next_pow2, num_sms  # noqa: F401 (interpreter fixes)

LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt, ROW, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + t)  # int64; a negative slot (a padding token) writes nothing
    mask = (offs < ROW) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q, m, denom, acc, rows_pos, b_table_ptr, k_cache_ptr, v_cache_ptr, kvh, start, end,
    stride_kb, stride_ks, stride_kh, scale_log2, window, softcap_log2,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys start .. start + BLOCK_N - 1 (those below `end`).
    q [R, Dp]; m, denom [R]; acc [R, Dp] fp32; rows_pos [R]: the last key each row sees (when CAUSAL
    or HAS_WINDOW); with HAS_WINDOW only keys after rows_pos - window; softcap_log2 = c·log2 e."""
    pos = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM_PAD)
    valid = pos < end
    block = tl.load(b_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh  # [N], int64: caches can pass 2^31
    kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [R, N]
    if HAS_SOFTCAP:  # s is score·log2 e: c·tanh(score / c)·log2 e
        x = s / softcap_log2
        s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * softcap_log2
    if CAUSAL:
        s = tl.where(pos[None, :] <= rows_pos[:, None], s, float("-inf"))
    else:
        s = tl.where(valid[None, :], s, float("-inf"))
    if HAS_WINDOW:
        s = tl.where(pos[None, :] > rows_pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite without a window: every row sees a key of its first tile
    m_safe = m_new
    if HAS_WINDOW:  # a row with no key yet keeps m = -inf, denom = 0, acc = 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    query_start_ptr, scale_log2, window, softcap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(query_start_ptr + b)  # b itself, unless some sequence has no new token
    if tl.load(query_start_ptr + b + 1) == row:
        return
    context_len = tl.load(context_lens_ptr + b)
    first_tile = 0
    if HAS_WINDOW:  # the tiles from the one holding the window's first key
        first_tile = tl.maximum(context_len - window, 0) // BLOCK_N
    num_tiles = tl.cdiv(context_len, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first = first_tile + split * per_split
    last = first_tile + tl.minimum((split + 1) * per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kvh * GROUP + g
    mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    rows_pos = tl.zeros([GROUP_PAD], tl.int32) + context_len - 1  # every row is the last token
    for tile in range(first, last):
        m, denom, acc = _attend_tile(
            q, m, denom, acc, rows_pos, block_tables_ptr + b * stride_bt, k_cache_ptr, v_cache_ptr, kvh,
            tile * BLOCK_N, context_len, stride_kb, stride_ks, stride_kh, scale_log2, window, softcap_log2,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, PRECISION, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip
    if NUM_SPLITS == 1:
        out = acc / denom[:, None]
        tl.store(
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:  # unnormalized partial state; a split past the context leaves m = -inf, denom = 0, acc = 0
        part = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [B, Hq, S] row-major
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=g[:, None] < GROUP)
        tl.store(part_ml_ptr + part * 2, m, mask=g < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, denom, mask=g < GROUP)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0), tl.program_id(1)
    row = tl.load(query_start_ptr + b)
    if tl.load(query_start_ptr + b + 1) == row:
        return
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_ml_ptr + part * 2)
    denom = tl.load(part_ml_ptr + part * 2 + 1)
    weight = tl.exp2(m - tl.max(m, 0))  # split 0 always holds keys, so the max is finite
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(denom * weight, 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr,
    num_seqs, scale_log2, window, softcap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    pid, kvh = tl.program_id(0), tl.program_id(1)
    # Sequence b owns the tiles first(b) .. first(b) + cdiv(Lq_b, BLOCK_Q) - 1, first(b) =
    # query_start[b] // BLOCK_Q + b (increasing, never overlapping): find the last b with first(b) <= pid.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(query_start_ptr + b)
    query_len = tl.load(query_start_ptr + b + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + b)
    if tile * BLOCK_Q >= query_len:  # the grid is an upper bound on the tiles
        return
    context_len = tl.load(context_lens_ptr + b)
    prefix = context_len - query_len  # tokens cached before this step's

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    token = tile * BLOCK_Q + r // GROUP  # row r: new token r // G of the tile, query head r % G of the group
    heads = kvh * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (token < query_len)
    mask = row_valid[:, None] & (d[None, :] < HEAD_DIM)
    rows = (q_start + token)[:, None]
    q = tl.load(q_ptr + rows * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    rows_pos = tl.where(row_valid, prefix + token, 0)  # padding rows see key 0 only: finite, never stored
    end = prefix + tl.minimum(query_len, (tile + 1) * BLOCK_Q)  # one past the last key the tile sees
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    lo = 0
    if HAS_WINDOW:  # from the tile holding the first key the tile's first row sees
        lo = tl.maximum(prefix + tile * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, end, BLOCK_N):
        m, denom, acc = _attend_tile(
            q, m, denom, acc, rows_pos, block_tables_ptr + b * stride_bt, k_cache_ptr, v_cache_ptr, kvh,
            start, end, stride_kb, stride_ks, stride_kh, scale_log2, window, softcap_log2,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, PRECISION, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip
    out = acc / denom[:, None]
    tl.store(
        out_ptr + rows * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta=None) -> str | None:
    """Why the kernels cannot take these tensors (None when they can)."""
    devices = {q.device, k_cache.device, v_cache.device}
    if meta is not None:
        devices |= {meta.block_tables.device, meta.context_lens.device, meta.query_start_loc.device}
    if len(devices) > 1:
        return f"tensors on different devices: {devices}"
    if k_cache.dtype != v_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtypes q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}"
    if q.dtype != k_cache.dtype:
        return "q and the caches differ in dtype"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "non-contiguous KV cache"
    if q.stride(-1) != 1:
        return "q's head_dim is strided"
    if q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} > 256"
    return None


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, Hkv, D] into the caches' slots (negative slots are skipped)."""
    num_tokens = slot_mapping.shape[0]
    row = k_cache.shape[2] * k_cache.shape[3]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k.device == k_cache.device == slot_mapping.device, (k.device, k_cache.device, slot_mapping.device)
    k, v = k.reshape(num_tokens, row), v.reshape(num_tokens, row)
    k = k if k.stride(1) == 1 else k.contiguous()
    v = v if v.stride(1) == 1 else v.contiguous()
    if num_tokens == 0:
        return
    block = min(next_pow2(row), 2048)
    grid = (num_tokens, triton.cdiv(row, block))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping.to(torch.int64), k.stride(0), v.stride(0), row, BLOCK=block
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,  # optkit.kernels.paged_attention.AttentionMetadata
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]. `num_splits` (decode) and `block_n` override the heuristics (tests,
    tuning); `window` and `softcap` as in optkit.kernels.paged_attention."""
    reason = unsupported_reason(q, k_cache, v_cache, meta)
    assert reason is None, reason
    num_tokens, q_heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    num_seqs = len(meta.query_lens)
    if num_tokens == 0 or num_seqs == 0:
        return out
    dim_pad = max(16, next_pow2(dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    wide = dim_pad <= 128 and q.dtype != torch.float32  # fp32 tiles at 64 x 64 spill registers
    block_n = block_n or (64 if wide else 32)
    strides = (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
    )  # fmt: skip
    tables, context_lens = meta.block_tables, meta.context_lens
    scale_log2 = scale * LOG2E
    flags = dict(HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None)
    window_arg, softcap_log2 = window or 0, (softcap or 1.0) * LOG2E

    if meta.max_query_len == 1:  # decode only: one query row per sequence
        group_pad = max(16, next_pow2(group))
        if num_splits is None:  # enough programs for two waves, each split at least 4 tiles long
            programs = num_seqs * kv_heads
            tiles = math.ceil(min(meta.max_context_len, window or meta.max_context_len) / block_n)
            num_splits = min(math.ceil(2 * num_sms(q.device) / programs), tiles // 4, 32)
        num_splits = next_pow2(max(1, num_splits))  # the merge kernel reads the splits as one power-of-2 tile
        part_acc = part_ml = out  # unused placeholders when there is one split
        if num_splits > 1:
            part_acc = torch.empty(num_seqs, q_heads, num_splits, dim_pad, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(num_seqs, q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
        _decode_kernel[(num_seqs, kv_heads, num_splits)](
            out, part_acc, part_ml, q, k_cache, v_cache, tables, context_lens, meta.query_start_loc, scale_log2,
            window_arg, softcap_log2, *strides,
            BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, PRECISION=precision, num_warps=4, num_stages=2, **flags,
        )  # fmt: skip
        if num_splits > 1:
            _merge_splits_kernel[(num_seqs, q_heads)](
                out, part_acc, part_ml, meta.query_start_loc, out.stride(0), out.stride(1),
                HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
            )  # fmt: skip
        return out

    block_m = max(16, next_pow2(group), 64 if wide else 32)
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, tables, meta.context_lens, meta.query_start_loc, num_seqs, scale_log2,
        window_arg, softcap_log2, *strides,
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n, PRECISION=precision, num_warps=4, num_stages=2, **flags,
    )  # fmt: skip
    return out
