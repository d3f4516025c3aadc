"""The 8-bit KV cache: one scale per block and KV head that fits every value the block stores, grows
with each write (requantizing the rows already there) and restarts with the block's next owner;
paged attention reads it as the dequantized values it stores; a block takes half a 16-bit one."""

import pytest
import torch

from optkit.kernels import cpu_decode
from optkit.kernels.kv_cache import QuantizedKVCache, allocate, bytes_per_block
from optkit.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
DTYPES = [torch.int8, torch.float8_e4m3fn]


def _cache(dtype, blocks=4, block=4, heads=2, dim=8) -> QuantizedKVCache:
    return QuantizedKVCache((blocks, block, heads, dim), dtype, torch.float32, "cpu")


def _read(cache: QuantizedKVCache) -> torch.Tensor:
    """Every slot, dequantized: [blocks · block_size, Hkv, D]."""
    return cache.index_select(0, torch.arange(cache.shape[0])).flatten(0, 1)


def _step_error(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """The most one rounding may move x [..., D] stored at scale [...]: half a step (int8), or 2^-4 of
    the value plus half a subnormal step (E4M3's 3 mantissa bits)."""
    s = scale.unsqueeze(-1)
    return 0.5 * s + 1e-7 if dtype == torch.int8 else x.abs() * 2**-4 + 2**-10 * s + 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_block_has_one_scale_per_head_that_fits_its_largest_value(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = _cache(dtype)
    x = torch.randn(8, 2, 8, generator=gen) * torch.tensor([1e-3, 1.0, 50.0, 0.5, 2.0, 7.0, 0.1, 3.0])[:, None, None]
    x[:, 1] = 0.0  # head 1 all zero: stays zero, scale 0
    cache.write(x, torch.arange(8))  # blocks 0 and 1, whole
    expected = torch.stack([x[:4].abs().amax(dim=(0, 2)), x[4:].abs().amax(dim=(0, 2))]) / QMAX[dtype]
    assert cache.scale.dtype == torch.float32 and cache.scale.shape == (4, 2)
    torch.testing.assert_close(cache.scale[:2], expected, rtol=0, atol=0)
    assert torch.equal(cache.scale[2:], torch.zeros(2, 2))  # untouched blocks hold nothing
    x_hat = _read(cache)[:8]
    scale = cache.scale[:2].repeat_interleave(4, dim=0)  # [8, Hkv]: each row's block scale
    assert ((x_hat - x).abs() <= _step_error(x, scale, dtype)).all()
    assert torch.equal(x_hat[:, 1], torch.zeros(8, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_growing_scale_requantizes_the_rows_already_written(dtype):
    cache = _cache(dtype, blocks=2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 8, generator=gen) * torch.tensor([1.0, 4.0, 0.5, 16.0])[:, None, None]
    for t in range(4):  # one token at a time, as decode writes
        s_before = cache.scale[0].clone()
        q_before = cache.data[0].clone()
        cache.write(x[t : t + 1], torch.tensor([t]))
        s_now = torch.maximum(s_before if t else torch.zeros(2), x[t].abs().amax(-1) / QMAX[dtype])
        torch.testing.assert_close(cache.scale[0], s_now, rtol=0, atol=0)  # only grows: max(old, new amax / QMAX)
        # the earlier rows are exactly q · s_old / s_new, rounded (int8) or cast (E4M3)
        ratio = (s_before / s_now)[None, :, None]
        again = q_before[:t].float() * ratio
        again = torch.round(again).to(dtype) if dtype == torch.int8 else again.to(dtype)
        assert torch.equal(cache.data[0, :t].view(torch.uint8), again.view(torch.uint8))
    # every row within the roundings of its life: once at its own write, once per growth after it
    x_hat = _read(cache)[:4]
    scales = torch.cummax(x.abs().amax(-1), dim=0).values / QMAX[dtype]  # [4, Hkv]: the scale after each write
    for t in range(4):
        bound = sum(_step_error(x[t], scales[u], dtype) for u in range(t, 4))
        assert ((x_hat[t] - x[t]).abs() <= bound).all(), t
    assert torch.equal(cache.scale[1], torch.zeros(2))  # the other block is untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_write_at_a_blocks_first_slot_restarts_its_scale(dtype):
    cache = _cache(dtype)
    cache.write(torch.full((4, 2, 8), 100.0), torch.arange(4))  # block 0, a first owner with large values
    small = torch.full((2, 2, 8), 0.5)
    cache.write(small, torch.tensor([0, 1]))  # block 0 freed and reallocated: the next owner starts at slot 0
    torch.testing.assert_close(cache.scale[0], torch.full((2,), 0.5 / QMAX[dtype]), rtol=0, atol=0)
    torch.testing.assert_close(_read(cache)[:2], small, rtol=0, atol=1e-6)  # stored at its own scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rewritten_slot_keeps_the_grown_scale_and_other_blocks_stay_as_they_were(dtype):
    """A speculative rollback writes slots again past the accepted tokens: the scale may only grow."""
    cache = _cache(dtype)
    gen = torch.Generator().manual_seed(2)
    first = torch.randn(6, 2, 8, generator=gen)
    cache.write(first, torch.tensor([0, 1, 2, 3, 4, 5]))  # block 0 whole, block 1 slots 0-1
    blocks_before, scale_before = cache.data.clone(), cache.scale.clone()
    proposal = torch.randn(2, 2, 8, generator=gen) * 30
    cache.write(proposal, torch.tensor([6, 7]))  # proposals grow block 1's scale ...
    assert (cache.scale[1] > scale_before[1]).all()
    grown = cache.scale[1].clone()
    cache.write(torch.randn(1, 2, 8, generator=gen) * 0.1, torch.tensor([6]))  # ... rejected, slot 6 rewritten
    torch.testing.assert_close(cache.scale[1], grown, rtol=0, atol=0)
    assert torch.equal(cache.data[0].view(torch.uint8), blocks_before[0].view(torch.uint8))  # block 0 untouched
    torch.testing.assert_close(cache.scale[0], scale_before[0], rtol=0, atol=0)
    x_hat = _read(cache)[4:6]  # block 1's accepted rows, requantized once
    bound = _step_error(first[4:6], scale_before[1], dtype) + _step_error(first[4:6], grown, dtype)
    assert ((x_hat - first[4:6]).abs() <= bound).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_paged_attention_reads_the_stored_values(kv_dtype, monkeypatch):
    # both caches through the PyTorch attention (the C++ kernel takes plain caches only): the same math
    monkeypatch.setattr(cpu_decode, "enabled", lambda x: False)
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
    new = [s[c - n :] for s, c, n in zip(slots_all, context, lens, strict=True)]
    meta = AttentionMetadata.build(lens, context, tables, [s for e in new for s in e])
    q = torch.randn(sum(lens), 4, dim, generator=gen)
    k_new = torch.randn(sum(lens), heads, dim, generator=gen) * 3  # larger: the blocks they join requantize
    v_new = torch.randn(sum(lens), heads, dim, generator=gen) * 3
    write_kv(k_new, v_new, k8, v8, meta.slot_mapping)
    every = torch.arange(8 * block)
    write_kv(_read(k8)[every], _read(v8)[every], k32, v32, every)  # what the 8-bit caches hold, in fp32
    out8 = paged_attention(q, k8, v8, meta, 0.25)
    out32 = paged_attention(q, k32, v32, meta, 0.25)
    torch.testing.assert_close(out8, out32, rtol=1e-6, atol=1e-6)  # the same numbers, read from 8 bits


def test_an_8bit_block_takes_half_a_16bit_blocks_data_plus_its_scales():
    layers, heads, dim, block = 4, 2, 64, 16
    full = bytes_per_block(layers, heads, dim, block, "auto", torch.bfloat16)
    assert full == 2 * layers * block * heads * dim * 2
    assert bytes_per_block(layers, heads, dim, block, "int8", torch.bfloat16, scales=False) * 2 == full
    eight = bytes_per_block(layers, heads, dim, block, "fp8", torch.bfloat16)
    assert eight == full // 2 + 2 * layers * heads * 4  # the side table: one float32 per block and KV head
    assert (eight - full // 2) / (full // 2) == pytest.approx(0.0039, abs=1e-4)  # 0.4% at D = 64, block 16
    cache = QuantizedKVCache((10, block, heads, dim), torch.int8, torch.bfloat16, "cpu")
    assert cache.nbytes == 10 * (block * heads * dim + heads * 4)
