"""GGUF's IQ4_NL blocks: 32 weights as 4-bit indices into a fixed non-uniform grid, one fp16 scale.

ggml-common.h: block_iq4_nl { ggml_half d; uint8_t qs[16]; } (18 bytes), x = d · kvalues_iq4nl[i]
with i the index in the low nibble of byte j for element j and in its high nibble for element j + 16
(dequantize_row_iq4_nl in ggml-quants.c, IQ4_NL.dequantize_blocks in gguf-py's quants.py).

`quantize` is llama.cpp's own: quantize_iq4_nl → quantize_row_iq4_nl_impl(32, 32, ..., ntry = 7) in
ggml-quants.c. Per block: with m the value of largest magnitude (its sign kept), the scale
d = Σ w·v·x / Σ w·v² of the indices nearest to x·(−127 + t)/m is kept for the t in −7..7 (and the
start d = m/127) that maximises (Σ w·v·x)² / Σ w·v²; the weights w are x² (no importance matrix) or
importance · √(σ² + x²) with σ² = 2·mean(x²) (llama.cpp's imatrix weighting). The indices are then
those nearest to x/d (float32 d; the block stores d in fp16). The sums run in float32 in llama.cpp's
order, column by column, so the bytes are ggml's.

Shapes: indices uint8 [rows, cols] in 0..15, d float16 [rows, cols / 32] -> uint8 [rows, cols / 32 · 18].
"""

import torch

BLOCK = 32
BLOCK_BYTES = 18
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
TRIES = 7  # ntry of quantize_iq4_nl
GROUP_MAX_EPS = 1e-15  # a block whose largest magnitude is below this has scale 0


def _values(device) -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=torch.float32, device=device)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"an IQ4_NL row holds whole blocks of {BLOCK}, got {cols} columns")
    return x.reshape(rows, cols // BLOCK, BLOCK)


def pack(indices: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """uint8 indices [R, C] in 0..15 and float16 scales [R, C/32] -> uint8 [R, C/32 · 18]."""
    blocks = _blocks(indices)
    if d.dtype != torch.float16 or d.shape != blocks.shape[:2]:
        raise ValueError(f"IQ4_NL: scales {tuple(d.shape)} {d.dtype} do not fit {tuple(blocks.shape[:2])} blocks")
    if blocks.max() > 15:
        raise ValueError("IQ4_NL holds indices in [0, 15]")
    halves = d.contiguous().view(torch.uint8).reshape(*d.shape, 2)
    nibbles = blocks[..., :16] | (blocks[..., 16:] << 4)
    return torch.cat([halves, nibbles], dim=-1).reshape(indices.shape[0], -1)


def unpack(data: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack`: (indices uint8 [R, C], d float16 [R, C/32])."""
    blocks = data.reshape(data.shape[0], cols // BLOCK, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(blocks.shape[:2])
    qs = blocks[..., 2:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(data.shape[0], cols), d


def dequantize(data: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [R, C]: d · kvalues_iq4nl[index], as dequantize_row_iq4_nl computes it."""
    indices, d = unpack(data, cols)
    values = _blocks(_values(data.device)[indices.long()])
    return (values * d.float().unsqueeze(-1)).reshape(data.shape[0], cols)


def nearest(x: torch.Tensor) -> torch.Tensor:
    """best_index_int8: the index of the grid value nearest to x (a tie goes to the larger value)."""
    values = _values(x.device)
    upper = torch.searchsorted(values, x.contiguous(), right=True).clamp(1, len(KVALUES) - 1)
    below = x - values[upper - 1] < values[upper] - x
    return torch.where(below, upper - 1, upper).to(torch.uint8)


def _sums(x: torch.Tensor, weight: torch.Tensor, scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·v·x, Σ w·v²) over each block's columns for v the grid value nearest `scaled`, in float32
    and in llama.cpp's order (j = 0..31): [N] each for blocks [N, 32]."""
    v = _values(x.device)[nearest(scaled).long()]
    sumqx = torch.zeros(x.shape[0], device=x.device)
    sumq2 = torch.zeros(x.shape[0], device=x.device)
    for j in range(BLOCK):
        sumqx = sumqx + weight[:, j] * v[:, j] * x[:, j]
        sumq2 = sumq2 + weight[:, j] * v[:, j] * v[:, j]
    return sumqx, sumq2


def _scales(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_iq4_nl_impl's scale of each block of x [N, 32] (float32 [N])."""
    if importance is None:
        weight = x * x
    else:
        sigma2 = torch.zeros(x.shape[0], device=x.device)
        for j in range(BLOCK):
            sigma2 = sigma2 + x[:, j] * x[:, j]
        # sqrtf is correctly rounded; torch's float32 sqrt need not be: the root of the float64, rounded once
        weight = importance * torch.sqrt(((sigma2 * (2.0 / BLOCK)).unsqueeze(-1) + x * x).double()).float()
    peak = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)  # largest magnitude, sign kept
    live = peak.abs() >= GROUP_MAX_EPS
    peak = torch.where(live, peak, torch.ones_like(peak))
    start = -peak / KVALUES[0]
    sumqx, sumq2 = _sums(x, weight, x * (1 / start).unsqueeze(-1))
    d = sumqx / sumq2
    best = d * sumqx
    for step in range(-TRIES, TRIES + 1):
        inverse = torch.full_like(peak, step + KVALUES[0]) / peak  # one rounding, as C's (itry + values[0])/max
        sumqx, sumq2 = _sums(x, weight, x * inverse.unsqueeze(-1))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = torch.where(better, sumqx / sumq2, d)
        best = torch.where(better, d * sumqx, best)
    return torch.where(live, d, torch.zeros_like(d))


def quantize(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's IQ4_NL of w [R, C] (float32): (indices uint8 [R, C], d float16 [R, C/32]).
    `importance` [C]: an importance matrix's column weights (None: llama.cpp's weighting without one)."""
    rows, cols = w.shape
    x = _blocks(w.float()).reshape(-1, BLOCK)
    weights = None if importance is None else _blocks(importance.float().expand(rows, cols)).reshape(-1, BLOCK)
    d = _scales(x, weights)
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    indices = nearest(x * inverse.unsqueeze(-1))
    return indices.reshape(rows, cols), d.to(torch.float16).reshape(rows, cols // BLOCK)
