"""GGUF's legacy block types, byte for byte: optkit's integers, scales and minima in llama.cpp's layout.

ggml (ggml/src/ggml-common.h) stores a quantized row of n weights as n / 32 blocks, each a struct:
  block_q4_0 { ggml_half d;              uint8_t qs[16]; }   18 bytes   x = (q_u − 8)·d
  block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }   20 bytes   x = q_u·d + m
  block_q5_0 { ggml_half d;              uint8_t qh[4]; uint8_t qs[16]; }   22 bytes   x = (q_u − 16)·d
  block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }   24 bytes   x = q_u·d + m
  block_q8_0 { ggml_half d;              int8_t  qs[32]; }   34 bytes   x = q·d
q_u is the unsigned level (0..15, 0..31 for Q5_*); byte j of qs holds the low 4 bits of element j in
its low nibble and those of element j + 16 in its high nibble; Q5's fifth bits are the little-endian
uint32 qh, bit j for element j (dequantize_row_q4_0, dequantize_row_q5_0 and dequantize_row_q5_1 in
ggml-quants.c; Q4_0/Q5_0/Q5_1.dequantize_blocks in gguf-py's quants.py). Halves are little-endian fp16.

In optkit's terms (weights/quantized.py, q signed in [qmin, qmax]):
  Q4_0 = symmetric 4-bit g32:  q_u = q + 8, d = s                  (z = 0)
  Q4_1 = asymmetric 4-bit g32 with a float zero point (weights/stored.py): q_u = q + 8, d = s, m = m
  Q5_0, Q5_1 = the same at 5 bits: q_u = q + 16 (llama-quantize's fallbacks for Q4_K and Q5_K, gguf_mix)
  Q8_0 = symmetric 8-bit g32:  q = q, d = s                        (z = 0)
Shapes: q int8 [rows, cols], s and m float16 [rows, cols / 32] -> uint8 [rows, cols / 32 · block bytes].
IQ4_NL's blocks (a 16-value non-uniform grid) are weights/gguf_iq4nl.py's.
Pure tensor math (no gguf import): formats/gguf.py writes the bytes into the container.
"""

import torch

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24}
# the integer width of each type with nibbles, and whether it stores a minimum m
LEVEL_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}
WITH_MINIMUM = ("Q4_1", "Q5_1")


def _halves(x: torch.Tensor) -> torch.Tensor:
    """float16 [R, B] -> uint8 [R, B, 2] (little-endian bytes of each half)."""
    assert x.dtype == torch.float16, x.dtype
    return x.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _unhalves(b: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B, 2] -> float16 [R, B]."""
    return b.contiguous().view(torch.float16).reshape(b.shape[:-1])


def _nibbles(q_u: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B, 32] in 0..15 -> uint8 [R, B, 16]: element j low, element j + 16 high."""
    return q_u[..., :16] | (q_u[..., 16:] << 4)


def _unnibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B, 16] -> uint8 [R, B, 32]."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(q_u: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B, 32] in 0..31 -> uint8 [R, B, 4]: the little-endian uint32 whose bit j is bit 4 of element j."""
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    bits = ((q_u >> 4) & 1).reshape(*q_u.shape[:-1], 4, 8)
    return (bits * weights).sum(dim=-1, dtype=torch.uint8)


def _unhigh_bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B, 4] -> uint8 [R, B, 32]: bit 4 of each element (0 or 16)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return (((qh.unsqueeze(-1) >> shifts) & 1) << 4).reshape(*qh.shape[:-1], 32)


def _blocks(q: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    if cols % BLOCK:
        raise ValueError(f"a GGUF row holds whole blocks of {BLOCK}, got {cols} columns")
    return q.reshape(rows, cols // BLOCK, BLOCK)


def pack(qtype: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of one tensor in `qtype`'s blocks: q int8 [R, C], d (and m for Q4_1, Q5_1) float16 [R, C/32]
    -> uint8 [R, C/32 · BLOCK_BYTES[qtype]]."""
    rows = q.shape[0]
    blocks = _blocks(q.to(torch.int16))
    if d.shape != blocks.shape[:2] or (m is not None and m.shape != d.shape):
        raise ValueError(f"{qtype}: scales {tuple(d.shape)} do not fit {tuple(blocks.shape[:2])} blocks")
    if qtype == "Q8_0":
        if blocks.min() < -128 or blocks.max() > 127:
            raise ValueError("Q8_0 holds integers in [-128, 127]")
        parts = [_halves(d), blocks.to(torch.int8).view(torch.uint8)]
    elif qtype in LEVEL_BITS:
        offset = 1 << (LEVEL_BITS[qtype] - 1)
        if blocks.min() < -offset or blocks.max() > offset - 1:
            raise ValueError(f"{qtype} holds integers in [{-offset}, {offset - 1}]")
        parts = [_halves(d)]
        if qtype in WITH_MINIMUM:
            assert m is not None, f"{qtype} needs the minima m"
            parts.append(_halves(m))
        q_u = (blocks + offset).to(torch.uint8)
        if offset == 16:
            parts.append(_high_bits(q_u))
        parts.append(_nibbles(q_u & 0x0F))
    else:
        raise ValueError(f"unknown block type {qtype!r}: optkit writes {', '.join(BLOCK_BYTES)}")
    return torch.cat(parts, dim=-1).reshape(rows, -1)


def unpack(qtype: str, data: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of `pack`: uint8 [R, C/32 · bytes] -> (q int8 [R, C], d float16 [R, C/32], m or None)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, cols // BLOCK, BLOCK_BYTES[qtype])
    d = _unhalves(blocks[..., 0:2])
    if qtype == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), d, None
    m = _unhalves(blocks[..., 2:4]) if qtype in WITH_MINIMUM else None
    qs = blocks[..., 4:] if qtype in WITH_MINIMUM else blocks[..., 2:]
    offset = 1 << (LEVEL_BITS[qtype] - 1)
    q_u = _unnibbles(qs[..., 4:]) | _unhigh_bits(qs[..., :4]) if offset == 16 else _unnibbles(qs)
    q = q_u.to(torch.int8) - offset
    return q.reshape(rows, cols), d, m


def dequantize(qtype: str, data: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [R, C], computed as ggml's dequantize_row_* does (q·d exact, then one rounding for + m)."""
    q, d, m = unpack(qtype, data, cols)
    if m is None:  # Q4_0: (q_u − 8)·d, Q5_0: (q_u − 16)·d, Q8_0: q·d
        x = _blocks(q).float() * d.float().unsqueeze(-1)
    else:  # Q4_1, Q5_1: q_u·d + m
        offset = 1 << (LEVEL_BITS[qtype] - 1)
        x = (_blocks(q).float() + offset) * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)
    return x.reshape(q.shape[0], cols)
