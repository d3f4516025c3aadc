"""A step's attention plan over the paged KV cache (kernels/paged_attention.py): its decodes attended
together, its short chunks in groups of one length, the longer chunks one by one; each group's block
tables and the masks of the keys its queries see (made once a step, shared by every layer)."""

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeGroup:
    """The step's decode sequences (query_len 1), attended together."""

    rows: torch.Tensor | slice  # rows of q: long [Bd], or a slice when they are 0..Bd-1
    block_tables: torch.Tensor  # long [Bd, nb]: only the blocks the longest of them uses
    lens: torch.Tensor  # long [Bd]: the keys of each sequence (its query the last)
    block_size: int
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def key_mask(self) -> torch.Tensor:
        """bool [Bd, 1, 1, nb * block_size]: True where the key is in the context. Made at the first
        use: the C++ decode attention takes the lens, and a step that runs it never needs the mask."""
        positions = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.lens.device)
        return (positions[None, :] < self.lens[:, None])[:, None, None, :]

    def mask(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.key_mask
        if window not in self._windowed:
            self._windowed[window] = window_mask(self.key_mask, window)
        return self._windowed[window]


def window_mask(key_mask: torch.Tensor, window: int) -> torch.Tensor:
    """key_mask [..., L] (each row a prefix: the n keys a query sees, itself last) narrowed to its
    last `window` keys."""
    visible = key_mask.sum(dim=-1, keepdim=True)  # [..., 1]: n = the query's position + 1
    positions = torch.arange(key_mask.shape[-1], device=key_mask.device)
    return key_mask & (positions >= visible - window)


GROUPED_MAX_QUERY = 32  # chunks up to this long are attended in groups of equal length


@dataclass
class ShortGroup:
    """Chunks of one length Lq (2 <= Lq <= GROUPED_MAX_QUERY), attended together."""

    rows: torch.Tensor  # long [Bs, Lq]: the rows of q of each sequence's chunk
    block_tables: torch.Tensor  # long [Bs, nb]
    key_mask: torch.Tensor  # bool [Bs, 1, Lq, nb * block_size]: query i of b sees keys < context_b - Lq + 1 + i
    visible: torch.Tensor  # long [Bs, Lq]: context_b - Lq + 1 + i, the keys query i of b sees
    # per (query heads per KV head, window)
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_for(self, group: int, window: int | None = None) -> torch.Tensor:
        """key_mask (narrowed to the window) with each query row repeated for the G query heads of a
        KV head: [Bs, 1, Lq * G, L]."""
        if (group, window) not in self._masks:
            mask = self.key_mask if window is None else window_mask(self.key_mask, window)
            self._masks[group, window] = mask.repeat_interleave(group, dim=2)
        return self._masks[group, window]


@dataclass
class Plan:
    decode: DecodeGroup | None
    chunks: list[tuple[int, int, int]]  # (sequence b, first row, query_len) of each longer chunk
    short: list[ShortGroup] = field(default_factory=list)
