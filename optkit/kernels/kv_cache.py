"""An 8-bit paged KV cache (int8 or FP8 E4M3), one scale per token and KV head computed at write time.

Layout per layer and for K and V each: data [num_blocks, block_size, Hkv, D] int8 or float8_e4m3fn,
scale [num_blocks, block_size, Hkv] bfloat16. Writing token t's row x [Hkv, D]:
    s[h] = bf16(max_d |x[h, d]| / QMAX)   (QMAX 127 for int8, 448 for E4M3; 1 for an all-zero row)
    q[h, d] = int8: clamp(round(x / s), ±127) | fp8: float8_e4m3fn(clamp(x / s, ±448))
and reading gives x̂ = q · s in the activation dtype. A slot is rewritten whole (data and scale), so
freed blocks, prefix-cache hits and speculative rollbacks need nothing more. The cache object has
the few tensor members paged attention reads (`shape`, `index_select` of whole blocks, dequantized),
so `paged_attention` runs on it unchanged; `write_kv` hands it the step's rows. The Triton kernels
take plain caches only (their `unsupported_reason` names the dtype), so an 8-bit cache runs the
PyTorch path on CUDA too.

Bytes per token and KV head: 2·D at 16 bits, D + 2 here (the bf16 scale): 1.94× the tokens at D = 64
in the same memory, 1.97× at D = 128.
"""

import torch

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.bfloat16


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hkv, D] -> (q [T, Hkv, D] in `dtype`, scale [T, Hkv] bf16), one scale per token and head."""
    x = x.float()
    qmax = _QMAX[dtype]
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).to(SCALE_DTYPE)
    scaled = (x / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)
    q = torch.round(scaled).to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., Hkv, D] and scale [..., Hkv] -> x̂ in `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


class QuantizedKVCache:
    """One layer's K (or V) cache in 8 bits; see the module doc."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, out_dtype: torch.dtype, device):
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = torch.ones(shape[:3], dtype=SCALE_DTYPE, device=device)
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
        # through a byte view: PyTorch's CPU index kernels have no float8 case
        data = self.data.view(torch.uint8).index_select(0, index).view(self.data.dtype)
        return dequantize_rows(data, self.scale.index_select(0, index), self.out_dtype)

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store rows x [T, Hkv, D] at the flat slots `slot_mapping` [T]."""
        heads, dim = self.data.shape[2:]
        q, scale = quantize_rows(x, self.data.dtype)
        self.data.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slot_mapping, q.view(torch.uint8))
        self.scale.view(-1, heads).index_copy_(0, slot_mapping, scale)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes in every layer (K and V): 2·L·H·D·itemsize at the model dtype,
    2·L·H·(D + 2) in 8 bits."""
    if kv_cache_dtype == "auto":
        return 2 * num_layers * kv_heads * head_dim * dtype.itemsize
    return 2 * num_layers * kv_heads * (head_dim + SCALE_DTYPE.itemsize)


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
