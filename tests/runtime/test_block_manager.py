import pytest

from optkit.runtime.block_manager import BlockManager, hash_block
from optkit.runtime.sequence import Sequence


def admit(bm: BlockManager, tokens: list[int]) -> Sequence:
    """Admit a sequence, take its cached prefix, and allocate and 'compute' the rest."""
    seq = Sequence(tokens)
    bm.allocate_cached_prefix(seq)
    assert bm.allocate_slots(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return seq


def test_allocate_slots_grows_the_table_and_fails_without_change():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence(list(range(6)))
    assert bm.allocate_slots(seq, 6)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2 and bm.usage == 0.5
    seq.num_computed_tokens = 6
    assert bm.allocate_slots(seq, 2)  # still fits in block 2
    assert len(seq.block_table) == 2
    assert not bm.allocate_slots(seq, 11)  # would need 5 blocks in all
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4 and bm.usage == 0.0
    bm.check_invariants()


def test_prefix_hits_are_shared_by_ref_count():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    a = admit(bm, prompt)
    assert bm.num_cached_blocks == 2
    b = Sequence(prompt + [99])
    assert bm.allocate_cached_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]
    assert bm.allocate_slots(b, len(b) - 8)
    assert b.block_table[2] != a.block_table[2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.usage == 0.0
    bm.check_invariants()


def test_a_different_prefix_does_not_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, list(range(10)))
    other = Sequence([0, 1, 2, 3, 7, 7, 7, 7, 8, 9])
    assert bm.allocate_cached_prefix(other) == 4  # only the first block matches; the chain breaks after


def test_never_caches_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = admit(bm, list(range(8)))  # exactly two full blocks
    bm.free(seq)
    again = Sequence(list(range(8)))
    assert bm.allocate_cached_prefix(again) == 4  # the block holding the last token is recomputed
    assert again.num_computed_tokens == 4 and len(again.block_table) == 1
    longer = Sequence(list(range(9)))
    assert bm.allocate_cached_prefix(longer) == 8


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = admit(bm, [1, 2, 3, 4, 5, 6, 7, 8])  # 4 full blocks, all hashed
    table = list(seq.block_table)
    bm.free(seq)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4 and bm.usage == 0.0
    # Taking one fresh block evicts the tail block of the freed sequence, not its head.
    other = Sequence([9, 9])
    assert bm.allocate_slots(other, 2)
    assert other.block_table == [table[3]]
    assert bm.num_cached_blocks == 3 and bm.num_evicted_blocks == 1
    resumed = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.allocate_cached_prefix(resumed) == 6
    assert resumed.block_table == table[:3]
    bm.check_invariants()


def test_lru_evicts_the_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = admit(bm, [1, 1, 1])  # block 0 full (hashed), block 1 partial
    b = admit(bm, [2, 2, 2])
    a_head = a.block_table[0]
    bm.free(a)
    bm.free(b)
    # Unhashed partial blocks hold nothing reusable: they go first; then a's head, then b's head.
    taker = Sequence([0] * 6)
    assert bm.allocate_slots(taker, 5)  # three blocks
    assert taker.block_table[2] == a_head
    assert bm.allocate_cached_prefix(Sequence([2, 2, 2])) == 2  # b's head survived
    assert bm.allocate_cached_prefix(Sequence([1, 1, 1])) == 0


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = admit(bm, list(range(10)))
    bm.free(a)
    assert bm.num_cached_blocks == 0
    assert bm.allocate_cached_prefix(Sequence(list(range(10)))) == 0


def test_double_free_asserts():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence([1, 2, 3])
    assert bm.allocate_slots(seq, 3)
    tables = [list(t) for t in seq.block_tables]
    bm.free(seq)
    seq.block_tables = tables
    with pytest.raises(AssertionError):
        bm.free(seq)


def test_hash_chains_the_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
