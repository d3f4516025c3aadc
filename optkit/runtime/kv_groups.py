"""KV cache groups: which layers share a block table, after vLLM's hybrid allocator. No torch.

A model whose layers all attend the same way (all full, or all the same sliding window: Llama,
Mistral) has one group, one block table per sequence. Gemma 2 and 3 alternate sliding and full
layers: keeping one table for both would hold every block for the full layers' sake, so each kind
gets its own group and table, and the sliding group releases the blocks that leave its window.

The groups share one pool of block ids and one set of cache tensors. Layers are split into groups
of equal size S (the smaller kind's layer count; the larger kind is cut into several groups of S,
the last one padded), and the j-th layer of every group uses cache tensor j, so a block id is one
slot [block_size, Hkv, D] in each of the S tensors: S layers' worth of memory, whatever the group
that holds it. Ids are unique across groups, so groups never overwrite each other's KV.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: the cache tensor it reads and writes
    num_slots: int  # cache tensors; a block id is one slot in each of them

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> "KVCacheGroups":
        """Every layer in one group (one table), its own cache tensor."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def for_windows(cls, windows: list[int | None]) -> "KVCacheGroups":
        """The groups of a model whose layer i has window windows[i] (None: full attention)."""
        kinds = list(dict.fromkeys(windows))  # full and sliding, in order of first appearance
        if len(kinds) == 1:
            return cls.single(len(windows), kinds[0])
        by_kind = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
        size = min(len(layers) for layers in by_kind.values())
        group_windows: list[int | None] = []
        layer_groups, layer_slots = [0] * len(windows), [0] * len(windows)
        for kind in kinds:
            layers = by_kind[kind]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_groups[layer], layer_slots[layer] = len(group_windows), slot
                group_windows.append(kind)
        return cls(tuple(group_windows), tuple(layer_groups), tuple(layer_slots), size)

    def num_block_ids(self, num_full_blocks: int) -> int:
        """The pool's block ids in the memory of `num_full_blocks` blocks of every layer."""
        return max(1, num_full_blocks * self.num_layers // self.num_slots)
