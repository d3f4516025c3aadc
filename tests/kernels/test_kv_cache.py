"""The 8-bit KV cache: rows round-trip within half a step of their own scale, and paged attention
reads it as the dequantized values it stores."""

import pytest
import torch

from optkit.kernels.kv_cache import QuantizedKVCache, allocate, bytes_per_token, quantize_rows
from optkit.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_each_token_and_head_gets_its_own_scale(dtype):
    x = torch.randn(6, 2, 32) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 2.0, 7.0]).reshape(6, 1, 1)
    q, scale = quantize_rows(x, dtype)
    assert q.dtype == dtype and scale.shape == (6, 2) and scale.dtype == torch.bfloat16
    x_hat = q.float() * scale.float().unsqueeze(-1)
    err = (x_hat - x).abs()
    if dtype == torch.int8:  # half a step of the row's own scale (the bf16 scale may clamp the top by <0.4%)
        assert (err <= 0.5 * scale.float().unsqueeze(-1) + 0.004 * x.abs().amax(-1, keepdim=True)).all()
    else:  # 3 mantissa bits: 2^-4 of each value, or half a subnormal step
        assert (err <= x.abs() * 2**-4 + 2**-10 * scale.float().unsqueeze(-1) + 1e-7).all()
    assert torch.equal(x_hat[3], torch.zeros(2, 32))  # an all-zero row stays zero


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_paged_attention_reads_the_stored_values(kv_dtype):
    heads, dim, block = 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    lens = [9, 1, 5]  # a prefill, a decode, a short chunk: every path of paged_attention
    context = [9, 6, 12]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    slots_all = [[t[p // block] * block + p % block for p in range(c)] for t, c in zip(tables, context, strict=True)]
    ((k8, v8),) = allocate(1, (8, block, heads, dim), kv_dtype, torch.float32, "cpu")
    k32, v32 = torch.zeros(8, block, heads, dim), torch.zeros(8, block, heads, dim)
    # the earlier tokens of each sequence, already in the caches
    earlier = [s[: c - n] for s, c, n in zip(slots_all, context, lens, strict=True)]
    slots = torch.tensor([s for e in earlier for s in e])
    k, v = torch.randn(len(slots), heads, dim, generator=gen), torch.randn(len(slots), heads, dim, generator=gen)
    write_kv(k, v, k8, v8, slots)
    write_kv(
        k8.index_select(0, torch.arange(8)).flatten(0, 1)[slots],
        v8.index_select(0, torch.arange(8)).flatten(0, 1)[slots],
        k32,
        v32,
        slots,
    )
    new = [s[c - n :] for s, c, n in zip(slots_all, context, lens, strict=True)]
    meta = AttentionMetadata.build(lens, context, tables, [s for e in new for s in e])
    q = torch.randn(sum(lens), 4, dim, generator=gen)
    k_new, v_new = torch.randn(sum(lens), heads, dim, generator=gen), torch.randn(sum(lens), heads, dim, generator=gen)
    write_kv(k_new, v_new, k8, v8, meta.slot_mapping)
    k_hat = k8.index_select(0, torch.arange(8)).flatten(0, 1)[meta.slot_mapping]
    v_hat = v8.index_select(0, torch.arange(8)).flatten(0, 1)[meta.slot_mapping]
    write_kv(k_hat, v_hat, k32, v32, meta.slot_mapping)
    out8 = paged_attention(q, k8, v8, meta, 0.25)
    out32 = paged_attention(q, k32, v32, meta, 0.25)
    torch.testing.assert_close(out8, out32, rtol=1e-6, atol=1e-6)  # the same numbers, read from 8 bits


def test_an_8bit_cache_takes_about_half_the_bytes_of_a_16bit_one():
    assert bytes_per_token(4, 2, 64, "auto", torch.bfloat16) == 2 * 4 * 2 * 64 * 2
    assert bytes_per_token(4, 2, 64, "int8", torch.bfloat16) == 2 * 4 * 2 * (64 + 2)
    cache = QuantizedKVCache((10, 16, 2, 64), torch.int8, torch.bfloat16, "cpu")
    assert cache.nbytes == 10 * 16 * 2 * (64 + 2)
