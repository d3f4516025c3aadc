"""An 8-bit paged KV cache (int8 or FP8 E4M3), one scale per block and KV head computed at write time,
as vLLM and FlashInfer keep per-head KV scales.

Layout per layer and for K and V each: data [num_blocks, block_size, Hkv, D] int8 or float8_e4m3fn,
scale [num_blocks, Hkv] float32, a side table like the block tables. Reading block b gives
x̂[b, i, h, :] = q[b, i, h, :] · s[b, h] in the activation dtype.

Writing a step's rows x [T, Hkv, D] at flat slots (block b = slot // block_size, offset slot % block_size),
for each block b the step touches and each head h:
    s_old = 0 if the step writes b's offset 0 (a fresh allocation: earlier rows are stale) else s[b, h]
    s_new = max(s_old, max over b's new rows and d of |x[., h, d]| / QMAX)   (QMAX 127 int8, 448 E4M3)
    rows already in b:  q ← requant(q · s_old / s_new)     (only where s_new > s_old; the ratio is ≤ 1)
    new rows:           q ← quant(x / s_new)               (an all-zero head keeps s 0 and stores zeros)
with quant/requant int8: clamp(round(·), ±127), fp8: float8_e4m3fn(clamp(·, ±448)). A scale only grows
within a block's life, so every value stored in b stays representable: requantizing adds at most half
a step of s_new (int8) or 2^-4 relative (E4M3) to the rows it touches, and only when s grows, which in
decode happens on the few tokens that raise the block's maximum.
Prefix-cache hits share full blocks, which are never written again; a speculative rollback rewrites
slots past the accepted tokens and can only grow the scale; preemption frees the blocks and the next
owner starts at offset 0. So none of them needs anything more.

The cache object has the few tensor members paged attention reads (`shape`, `index_select` of whole
blocks, dequantized), so `paged_attention` runs on it unchanged; `write_kv` hands it the step's rows.
The Triton kernels take plain caches only (their `unsupported_reason` names the dtype), so an 8-bit
cache runs the PyTorch path on CUDA too, eagerly (`write` finds the touched blocks on the host).

Bytes: a block holds block_size·Hkv·D bytes of data per layer, K and V each, half a 16-bit block's, plus
the side table's 4·Hkv bytes: 4 / (block_size · D) of the data, 0.4% at D = 64 and block 16.
"""

import torch

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] / scale [..., Hkv] -> q in `dtype`; a zero scale (nothing to store) gives zeros."""
    qmax = _QMAX[dtype]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    scaled = (x.float() / safe).clamp(-qmax, qmax)
    return torch.round(scaled).to(dtype) if dtype == torch.int8 else scaled.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., Hkv, D] and scale [..., Hkv] -> x̂ in `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def grown_scale(s_old: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's scale after a write: s_old [..., Hkv] (0 for a fresh block), amax [..., Hkv] the new
    rows' max |x| per head -> max(s_old, amax / QMAX)."""
    return torch.maximum(s_old, amax.float() / _QMAX[dtype])


def requantize(q: torch.Tensor, s_old: torch.Tensor, s_new: torch.Tensor) -> torch.Tensor:
    """Blocks q [U, block_size, Hkv, D] stored at s_old [U, Hkv], re-expressed at s_new >= s_old:
    q · s_old / s_new, rounded (int8) or cast (E4M3). A zero s_new means nothing was stored."""
    ratio = torch.where(s_new > 0, s_old / torch.where(s_new > 0, s_new, torch.ones_like(s_new)), 0.0)
    scaled = q.float() * ratio[:, None, :, None]  # |.| <= QMAX: the ratio is <= 1
    return torch.round(scaled).to(q.dtype) if q.dtype == torch.int8 else scaled.to(q.dtype)


class QuantizedKVCache:
    """One layer's K (or V) cache in 8 bits; see the module doc."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, out_dtype: torch.dtype, device):
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = torch.zeros((shape[0], shape[2]), dtype=SCALE_DTYPE, device=device)  # 0: nothing stored
        self.out_dtype = out_dtype  # what reads return: the activation dtype

    # the tensor members paged attention reads
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous()

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Whole blocks, dequantized: [len(index), block_size, Hkv, D] in the activation dtype."""
        assert dim == 0, dim
        blocks = self._blocks(index)
        return (blocks.float() * self.scale.index_select(0, index)[:, None, :, None]).to(self.out_dtype)

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store rows x [T, Hkv, D] at the flat slots `slot_mapping` [T] (module doc: the scale update)."""
        block_size, heads, dim = self.data.shape[1:]
        assert x.shape == (slot_mapping.shape[0], heads, dim), (x.shape, self.data.shape)
        block_of, offset = slot_mapping // block_size, slot_mapping % block_size
        touched, which = torch.unique(block_of, return_inverse=True)  # [U]; row t is in touched[which[t]]
        num = touched.shape[0]
        row_amax = x.float().abs().amax(-1)  # [T, Hkv]
        amax = torch.zeros(num, heads, device=x.device).scatter_reduce_(
            0, which[:, None].expand(-1, heads), row_amax, "amax"
        )  # [U, Hkv]: the new rows' max per block and head
        fresh = torch.zeros(num, device=x.device).index_add_(0, which, (offset == 0).float()) > 0  # [U]
        s_old = torch.where(fresh[:, None], 0.0, self.scale.index_select(0, touched))  # [U, Hkv]
        s_new = grown_scale(s_old, amax, self.data.dtype)
        # the rows a block already holds, re-expressed at its grown scale (fresh blocks hold nothing)
        grown = ((s_new > s_old) & (s_old > 0)).any(-1)
        if grown.any():
            ids = touched[grown]
            requantized = requantize(self._blocks(ids), s_old[grown], s_new[grown])
            self.data.view(torch.uint8).index_copy_(0, ids, requantized.view(torch.uint8))
        q = quantize(x, s_new[which], self.data.dtype)
        self.data.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slot_mapping, q.view(torch.uint8))
        self.scale.index_copy_(0, touched, s_new)

    def _blocks(self, index: torch.Tensor) -> torch.Tensor:
        # through a byte view: PyTorch's CPU index kernels have no float8 case
        return self.data.view(torch.uint8).index_select(0, index).view(self.data.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def bytes_per_block(
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_cache_dtype: str,
    dtype: torch.dtype,
    *,
    scales: bool = True,
) -> int:
    """KV cache bytes of one block in every layer (K and V): 2·L·block_size·H·D·itemsize at the model
    dtype; in 8 bits 2·L·block_size·H·D plus, with `scales`, the side table's 2·L·H·4."""
    if kv_cache_dtype == "auto":
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize
    table = 2 * num_layers * kv_heads * SCALE_DTYPE.itemsize if scales else 0
    return 2 * num_layers * block_size * kv_heads * head_dim + table


def allocate(
    num_layers: int, shape: tuple[int, int, int, int], kv_cache_dtype: str, dtype: torch.dtype, device
) -> list[tuple]:
    """One (k_cache, v_cache) pair per layer: plain tensors of `dtype` ("auto"), or 8-bit caches."""
    if kv_cache_dtype == "auto":
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
    storage = KV_CACHE_DTYPES[kv_cache_dtype]
    return [
        (QuantizedKVCache(shape, storage, dtype, device), QuantizedKVCache(shape, storage, dtype, device))
        for _ in range(num_layers)
    ]
