import pytest
import torch
import torch.nn.functional as F

from optkit.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv
from tests.kernels import paged_steps
from tests.kernels.paged_steps import paged_attention_reference

HQ, HKV, D = 8, 2, 16


def random_step(query_lens, context_lens, block_size, seed=0, dtype=torch.float32):
    return paged_steps.random_step(query_lens, context_lens, block_size, (HQ, HKV), D, dtype, seed=seed)


MIXED = [
    # (query_lens, context_lens): decodes, fresh prefills, chunks after cached prefixes, in any order
    ([1, 9, 5, 1, 1, 2], [13, 9, 20, 1, 33, 7]),
    ([7, 1, 1, 1], [30, 4, 17, 16]),
    ([1, 1, 1], [5, 40, 16]),  # decodes only
    ([12, 3], [12, 40]),  # chunks only
    ([1], [1]),
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("lens", MIXED)
def test_matches_the_naive_reference_on_mixed_batches(lens, block_size):
    q, _, _, k_cache, v_cache, meta = random_step(*lens, block_size, seed=block_size)
    scale = D**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, paged_attention_reference(q, k_cache, v_cache, meta, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_reference_on_random_batches(seed):
    rng = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 8, (1,), generator=rng))
    context_lens = torch.randint(1, 50, (batch,), generator=rng).tolist()
    query_lens = [
        1 if torch.rand(1, generator=rng) < 0.5 else int(torch.randint(1, c + 1, (1,), generator=rng))
        for c in context_lens
    ]
    q, _, _, k_cache, v_cache, meta = random_step(query_lens, context_lens, 8, seed=seed)
    out = paged_attention(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, paged_attention_reference(q, k_cache, v_cache, meta, 0.3), atol=1e-5, rtol=1e-5)


def test_matches_causal_sdpa_on_whole_sequences():
    """Fresh prefills: the paged result is plain causal attention of each sequence with itself."""
    lens = [6, 23, 1, 40]
    q, k, v, k_cache, v_cache, meta = random_step(lens, lens, 4)
    out = paged_attention(q, k_cache, v_cache, meta, D**-0.5)
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        kk, vv = (t[rows].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1) for t in (k, v))
        expected = F.scaled_dot_product_attention(q[rows].transpose(0, 1), kk, vv, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        start += n


def test_chunks_and_decodes_give_the_prefill_result():
    """One sequence computed as chunks, then token by token, equals its single prefill."""
    block_size, length = 4, 30
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, h, D, generator=gen) for h in (HQ, HKV, HKV))
    table = torch.randperm(8, generator=gen).tolist()

    def run(pieces):
        k_cache, v_cache = torch.zeros(8, block_size, HKV, D), torch.zeros(8, block_size, HKV, D)
        outs, done = [], 0
        for n in pieces:
            slots = [table[t // block_size] * block_size + t % block_size for t in range(done, done + n)]
            meta = AttentionMetadata.build([n], [done + n], [table], slots)
            rows = slice(done, done + n)
            write_kv(k[rows], v[rows], k_cache, v_cache, meta.slot_mapping)
            outs.append(paged_attention(q[rows], k_cache, v_cache, meta, D**-0.5))
            done += n
        return torch.cat(outs)

    torch.testing.assert_close(run([11, 7, 1, 1, 5, 1, 1, 1, 1, 1]), run([length]), atol=1e-5, rtol=1e-5)


def test_write_kv_fills_the_slots_of_the_block_table():
    q, k, v, k_cache, v_cache, meta = random_step([3, 1], [6, 9], 4)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    assert torch.equal(flat_k[meta.slot_mapping], k) and torch.equal(flat_v[meta.slot_mapping], v)


def test_build_pads_block_tables_and_locates_queries():
    meta = AttentionMetadata.build([3, 1, 2], [3, 9, 6], [[4], [0, 2, 5], [1, 3]], [16, 17, 18, 21, 6, 7])
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6] and meta.query_start_loc.dtype == torch.int32
    assert meta.block_tables.tolist() == [[4, 0, 0], [0, 2, 5], [1, 3, 0]] and meta.block_tables.dtype == torch.int32
    assert meta.context_lens.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_context_len, meta.context_lens_list) == (3, 9, [3, 9, 6])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_decode_only_steps_plan_is_the_general_plans(block_size):
    """Every sequence one decode (a multi-step's steps): the plan's short path gives the plan the
    general path makes of the same step, tables and lens alike."""
    import dataclasses

    meta = AttentionMetadata.build([1, 1, 1], [5, 40, 17], [[4, 1], [0, 2, 5, 6, 7], [1, 3]], [9, 33, 60])
    fast = meta.plan(block_size)
    general = AttentionMetadata._make_plan(dataclasses.replace(meta, max_query_len=2), block_size)
    assert fast.chunks == general.chunks == [] and fast.short == general.short == []
    assert fast.decode.rows == general.decode.rows == slice(0, 3)
    assert fast.decode.block_size == general.decode.block_size == block_size
    for got, want in [(fast.decode.block_tables, general.decode.block_tables), (fast.decode.lens, general.decode.lens)]:
        assert got.dtype == want.dtype == torch.long and torch.equal(got, want)


def test_bfloat16_caches():
    q, _, _, k_cache, v_cache, meta = random_step([1, 5, 1], [7, 12, 3], 4, dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, meta, D**-0.5)
    assert out.dtype == torch.bfloat16
    expected = paged_attention_reference(q, k_cache, v_cache, meta, D**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
