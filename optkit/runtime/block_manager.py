"""Paged KV-cache bookkeeping: which cache blocks each sequence holds, shared by ref count, and a
prefix cache of full blocks keyed by a hash chain. No torch: the tensors live in the model runner.

A block is either held (ref_count > 0) or free. Free blocks sit in an LRU pool, least recently
freed first; a free block may still carry the hash of the tokens whose KV it holds, so a later
sequence with the same prefix can take it back instead of recomputing it. Taking a free block
for new tokens evicts its hash.

KV cache groups (runtime/kv_groups.py): a sequence holds one block table per group, all drawn from
the one pool. In a group with a sliding window (every layer of Mistral, Gemma's local layers), the
blocks of a sequence that lie wholly before the window of every token it will still compute are
released early (`free_out_of_window`; docs/runtime.md): their table entries stay, as positions the
attention mask hides, and are skipped when the sequence frees its blocks. A full-attention group
keeps all of them. A prefix-cache hit needs the block in every group (each group caches its own
copy of the same tokens' KV, under the same hash).
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from optkit.runtime.sequence import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """The hash of a full block: its parent's hash chained with its tokens, so equal hashes mean
    equal prefixes. sha256 makes collisions (which would serve another prompt's KV) negligible."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None  # set once the block is full of computed tokens
    group: int = 0  # the KV cache group whose table holds it (whose prefix cache names it)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] | None = None,
    ):
        """One group with `sliding_window` (None: full attention), or one group per entry of
        `group_windows` (KVCacheGroups.windows)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows) if group_windows is not None else (sliding_window,)
        assert self.group_windows, "at least one KV cache group"
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evicted first
        # per group: hash -> block id holding those tokens' KV
        self._cached: list[dict[BlockHash, int]] = [{} for _ in self.group_windows]
        self.num_prefix_query_tokens = 0  # tokens looked up in the prefix cache on admission
        self.num_prefix_hit_tokens = 0  # ... of which were found
        self.num_evicted_blocks = 0
        self._out_of_window: dict[tuple[int, int], int] = {}  # (group, seq_id) -> leading blocks released
        self.num_window_freed_blocks = 0

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def sliding_window(self) -> int | None:
        """The window of a single-group manager (None: full attention, or several groups)."""
        return self.group_windows[0] if self.num_groups == 1 else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(cached) for cached in self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached but unreferenced blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks covering num_tokens tokens in one group's table."""
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens may hold at once: a full table in every
        group (a sliding group holds them all while one prefill chunk covers them)."""
        return self.num_groups * self.num_blocks_for(num_tokens)

    @property
    def max_tokens_held(self) -> int:
        """The longest sequence the whole pool can hold, a full table in every group."""
        return self.num_blocks // self.num_groups * self.block_size

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence holds now, in all groups (those released from a window not counted)."""
        released = sum(self._out_of_window.get((g, seq.seq_id), 0) for g in range(len(seq.block_tables)))
        return sum(len(table) for table in seq.block_tables) - released

    def _tables(self, seq: Sequence) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.group_windows]
        assert len(seq.block_tables) == self.num_groups, f"{seq} has tables of another KV cache layout"
        return seq.block_tables

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence being admitted the longest run of cached full blocks matching its tokens
        (in every group); they count as computed. Returns the number of cached tokens. The last
        token is never taken from the cache: it must be computed to produce the logits of the next one."""
        assert not any(seq.block_tables), f"{seq} already holds blocks"
        tables = self._tables(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        if not self.enable_prefix_caching:
            return 0
        # Only blocks lying entirely before the last token can match.
        max_blocks = (len(seq) - 1) // self.block_size
        self.num_prefix_query_tokens += len(seq)
        parent: BlockHash | None = None
        for i in range(max_blocks):
            parent = hash_block(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_ids = [cached.get(parent) for cached in self._cached]
            if None in block_ids:
                break
            for table, block_id in zip(tables, block_ids, strict=True):
                self._take(block_id)
                table.append(block_id)
        num_cached = len(tables[0]) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        self.num_prefix_hit_tokens += num_cached
        return num_cached

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Grow every group's block table to cover `num_computed_tokens + num_new_tokens +
        num_lookahead_tokens` tokens (lookahead: slots for speculative proposals); False (and no
        change) when there are not enough free blocks."""
        tables = self._tables(seq)
        wanted = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens + num_lookahead_tokens)
        if sum(max(0, wanted - len(table)) for table in tables) > len(self._free):
            return False
        for group, table in enumerate(tables):
            for _ in range(wanted - len(table)):
                block_id, _ = self._free.popitem(last=False)
                block = self.blocks[block_id]
                if block.hash is not None:
                    self._evict(block)
                block.ref_count, block.group = 1, group
                table.append(block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of the sequence's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        for group, table in enumerate(self._tables(seq)):
            num_full = min(seq.num_computed_tokens // self.block_size, len(table))
            # Blocks are hashed in order, so the unhashed ones are a run at the end of the full ones.
            first_unhashed = num_full
            while first_unhashed > 0 and self.blocks[table[first_unhashed - 1]].hash is None:
                first_unhashed -= 1
            parent = self.blocks[table[first_unhashed - 1]].hash if first_unhashed else None
            for i in range(first_unhashed, num_full):
                block = self.blocks[table[i]]
                parent = block.hash = hash_block(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                # Two sequences may compute the same block at once; the first one stays the cached copy.
                self._cached[group].setdefault(block.hash, block.block_id)

    def free_surplus(self, seq: Sequence) -> None:
        """Release the blocks past those holding the computed tokens: the lookahead slots of
        speculative proposals the target rejected. Such blocks were never hashed (a hash needs a
        block full of computed tokens), so they hold nothing reusable."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        for table in self._tables(seq):
            for block_id in reversed(table[keep:]):
                block = self.blocks[block_id]
                assert block.ref_count == 1 and block.hash is None, f"surplus block {block_id} is shared or cached"
                block.ref_count = 0
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
            del table[keep:]

    def free_out_of_window(self, seq: Sequence) -> int:
        """In each sliding group, release the sequence's blocks that no token it computes from now
        on can see: every position in them is before num_computed_tokens - window + 1, the first key
        the next token (at position num_computed_tokens or later: speculative rejection never goes
        below it) sees. With prefix caching, the last hashed block stays held, so
        `cache_full_blocks` always finds its parent hash in a block of this sequence. Returns how
        many blocks were released."""
        released = 0
        for group, window in enumerate(self.group_windows):
            if window is not None:
                released += self._free_group_out_of_window(seq, group, window)
        return released

    def _free_group_out_of_window(self, seq: Sequence, group: int, window: int) -> int:
        table = self._tables(seq)[group]
        first_seen = max(0, seq.num_computed_tokens - window + 1)
        end = min(first_seen // self.block_size, len(table))
        start = self._out_of_window.get((group, seq.seq_id), 0)
        if self.enable_prefix_caching:  # the held blocks from `start` on are this sequence's: their hashes stay
            hashed = start
            while hashed < len(table) and self.blocks[table[hashed]].hash is not None:
                hashed += 1
            end = min(end, hashed - 1)
        for block_id in table[start : max(start, end)]:
            self._release(self.blocks[block_id])
        if end > start:
            self._out_of_window[group, seq.seq_id] = end
            self.num_window_freed_blocks += end - start
        return max(0, end - start)

    def _release(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None
            if block.hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Tail blocks enter the pool first so they are evicted first
        (a prefix's first blocks are the most shareable); blocks without a hash hold nothing
        reusable and go to the very front."""
        for group, table in enumerate(seq.block_tables):
            released = self._out_of_window.pop((group, seq.seq_id), 0)  # those left behind by the window
            for block_id in reversed(table[released:]):
                self._release(self.blocks[block_id])
        seq.block_tables = []

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _evict(self, block: Block) -> None:
        cached = self._cached[block.group]
        if cached.get(block.hash) == block.block_id:
            del cached[block.hash]
        block.hash = None
        self.num_evicted_blocks += 1

    def check_invariants(self) -> None:
        """For tests: the free pool is exactly the unreferenced blocks, each group's cache points at
        hashed blocks of that group."""
        assert set(self._free) == {b.block_id for b in self.blocks if b.ref_count == 0}
        for group, cached in enumerate(self._cached):
            assert all(self.blocks[i].hash == h and self.blocks[i].group == group for h, i in cached.items())
