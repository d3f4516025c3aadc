"""Bit packing of unsigned integer fields into int32 words, as the checkpoint formats and the
packed-integer kernels store them (the storage layout is described in optkit/kernels/packed_int.py)."""

import torch
import torch.nn.functional as F


def field_bits(bits: int) -> int:
    """The width of the field that holds one value: 2, 4, or 8 (a plain int8)."""
    assert 1 <= bits <= 8, bits
    return 2 if bits <= 2 else 4 if bits <= 4 else 8


def pack_int32(u: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned ints [R, C] below 2^width -> int32 [R, ceil(C / per_word)], per_word = 32 / width:
    value j of a word in bits j·width .. (j + 1)·width - 1 (the last field may set the sign bit)."""
    per_word = 32 // width
    rows, cols = u.shape
    padded = F.pad(u.to(torch.int32), (0, -cols % per_word)).reshape(rows, -1, per_word)
    words = padded[..., 0].clone()
    for j in range(1, per_word):  # fields do not overlap: OR them in, in int32 (half int64's bytes)
        words |= padded[..., j] << (j * width)
    return words


def unpack_int32(packed: torch.Tensor, width: int, cols: int) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 [R, W] -> int32 [R, cols]."""
    per_word = 32 // width
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * width
    # an arithmetic shift of a negative word only fills the top bits, which the mask drops
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << width) - 1)  # [R, W, per_word]
    return fields.reshape(packed.shape[0], -1)[:, :cols]
