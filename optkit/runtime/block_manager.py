"""Paged KV-cache bookkeeping: which cache blocks each sequence holds, shared by ref count, and a
prefix cache of full blocks keyed by a hash chain. No torch: the tensors live in the model runner.

A block is either held (ref_count > 0) or free. Free blocks sit in an LRU pool, least recently
freed first; a free block may still carry the hash of the tokens whose KV it holds, so a later
sequence with the same prefix can take it back instead of recomputing it. Taking a free block
for new tokens evicts its hash.

With a sliding window on every layer (Mistral; `sliding_window`), the blocks of a sequence that lie
wholly before the window of every token it will still compute are released early
(`free_out_of_window`; docs/runtime.md): their table entries stay, as positions the attention mask
hides, and are skipped when the sequence frees its blocks.
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


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evicted first
        self._cached: dict[BlockHash, int] = {}  # hash -> block id holding those tokens' KV
        self.num_prefix_query_tokens = 0  # tokens looked up in the prefix cache on admission
        self.num_prefix_hit_tokens = 0  # ... of which were found
        self.num_evicted_blocks = 0
        self.sliding_window = sliding_window
        self._out_of_window: dict[int, int] = {}  # seq_id -> its leading blocks already released
        self.num_window_freed_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached but unreferenced blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence being admitted the longest run of cached full blocks matching its tokens;
        they count as computed. Returns the number of cached tokens. The last token is never taken
        from the cache: it must be computed to produce the logits of the next one."""
        assert not seq.block_table, f"{seq} already holds blocks"
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        if not self.enable_prefix_caching:
            return 0
        # Only blocks lying entirely before the last token can match.
        max_blocks = (len(seq) - 1) // self.block_size
        self.num_prefix_query_tokens += len(seq)
        parent: BlockHash | None = None
        for i in range(max_blocks):
            parent = hash_block(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
        num_cached = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        self.num_prefix_hit_tokens += num_cached
        return num_cached

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Grow the block table to cover `num_computed_tokens + num_new_tokens + num_lookahead_tokens`
        tokens (lookahead: slots for speculative proposals); False (and no change) when there are not
        enough free blocks."""
        num_tokens = seq.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of the sequence's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        # Blocks are hashed in order, so the unhashed ones are a run at the end of the full ones.
        first_unhashed = num_full
        while first_unhashed > 0 and self.blocks[seq.block_table[first_unhashed - 1]].hash is None:
            first_unhashed -= 1
        parent = self.blocks[seq.block_table[first_unhashed - 1]].hash if first_unhashed else None
        for i in range(first_unhashed, num_full):
            block = self.blocks[seq.block_table[i]]
            parent = block.hash = hash_block(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            # Two sequences may compute the same block at once; the first one stays the cached copy.
            self._cached.setdefault(block.hash, block.block_id)

    def free_surplus(self, seq: Sequence) -> None:
        """Release the blocks past those holding the computed tokens: the lookahead slots of
        speculative proposals the target rejected. Such blocks were never hashed (a hash needs a
        block full of computed tokens), so they hold nothing reusable."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, f"surplus block {block_id} is shared or cached"
            block.ref_count = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def free_out_of_window(self, seq: Sequence) -> int:
        """Release the sequence's blocks that no token it computes from now on can see: every
        position in them is before num_computed_tokens - sliding_window + 1, the first key the next
        token (at position num_computed_tokens or later: speculative rejection never goes below it)
        sees. With prefix caching, the last hashed block stays held, so `cache_full_blocks` always
        finds its parent hash in a block of this sequence. Returns how many blocks were released."""
        if self.sliding_window is None:
            return 0
        first_seen = max(0, seq.num_computed_tokens - self.sliding_window + 1)
        end = min(first_seen // self.block_size, len(seq.block_table))
        start = self._out_of_window.get(seq.seq_id, 0)
        if self.enable_prefix_caching:  # the held blocks from `start` on are this sequence's: their hashes stay
            hashed = start
            while hashed < len(seq.block_table) and self.blocks[seq.block_table[hashed]].hash is not None:
                hashed += 1
            end = min(end, hashed - 1)
        for block_id in seq.block_table[start : max(start, end)]:
            self._release(self.blocks[block_id])
        if end > start:
            self._out_of_window[seq.seq_id] = end
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
        released = self._out_of_window.pop(seq.seq_id, 0)  # those left behind by the window
        for block_id in reversed(seq.block_table[released:]):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken ({seq})"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _evict(self, block: Block) -> None:
        if self._cached.get(block.hash) == block.block_id:
            del self._cached[block.hash]
        block.hash = None
        self.num_evicted_blocks += 1

    def check_invariants(self) -> None:
        """For tests: the free pool is exactly the unreferenced blocks, the cache points at hashed blocks."""
        assert set(self._free) == {b.block_id for b in self.blocks if b.ref_count == 0}
        assert all(self.blocks[i].hash == h for h, i in self._cached.items())
