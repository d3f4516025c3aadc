"""ggml's K-quant super-blocks, byte for byte (ggml/src/ggml-common.h, QK_K = 256 weights each).

  block_q2_K { uint8 scales[16]; uint8 qs[64]; half d; half dmin; }                      84 bytes
  block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d; }                110 bytes
  block_q4_K { half d; half dmin; uint8 scales[12]; uint8 qs[128]; }                     144 bytes
  block_q5_K { half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; }       176 bytes
  block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; }                   210 bytes

A weight is a level q_u (0 .. 2^bits − 1) of its sub-block j (16 or 32 columns) with sub-scale
sc_j and, for Q2_K/Q4_K/Q5_K, sub-minimum m_j (dequantize_row_q*_K in ggml-quants.c):
  Q2_K, Q4_K, Q5_K:  x = (d·sc_j)·q_u − dmin·m_j        sc, m unsigned: 4 bits (Q2_K) or 6 bits
  Q3_K, Q6_K:        x = (d·sc_j)·(q_u − 2^(bits−1))    sc signed: 6 bits (Q3_K, stored + 32) or int8
Pure tensor functions on uint8 [R, B, ...] (R rows, B super-blocks per row); no gguf import.
"""

from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class KType:
    bits: int  # bits of a level q_u
    sub: int  # columns per sub-block
    symmetric: bool  # no sub-minimum: x = d·sc·(q_u − 2^(bits−1))
    block_bytes: int
    sc_min: int  # range of a stored sub-scale (and sub-minimum)
    sc_max: int

    @property
    def subs(self) -> int:
        return QK_K // self.sub


TYPES = {
    "Q2_K": KType(2, 16, False, 84, 0, 15),
    "Q3_K": KType(3, 16, True, 110, -32, 31),
    "Q4_K": KType(4, 32, False, 144, 0, 63),
    "Q5_K": KType(5, 32, False, 176, 0, 63),
    "Q6_K": KType(6, 16, True, 210, -128, 127),
}


@dataclass
class KGrid:
    """One tensor's super-block parameters: d (and dmin) float16 [R, B]; sc (and m) int16 [R, B·subs]."""

    d: torch.Tensor
    sc: torch.Tensor
    dmin: torch.Tensor | None = None
    m: torch.Tensor | None = None

    def scales(self) -> torch.Tensor:
        """d·sc_j per sub-block, float32 [R, B·subs], as ggml's dequantizer forms it (one fp32 product)."""
        return self.d.float().repeat_interleave(self.sc.shape[1] // self.d.shape[1], dim=1) * self.sc.float()

    def zeros(self) -> torch.Tensor | None:
        """−dmin·m_j per sub-block, float32 [R, B·subs] (None for Q3_K/Q6_K): x = scale·q_u + zero."""
        if self.dmin is None:
            return None
        return -(self.dmin.float().repeat_interleave(self.m.shape[1] // self.dmin.shape[1], dim=1) * self.m.float())


def _halves(x: torch.Tensor) -> torch.Tensor:
    """float16 [R, B] -> uint8 [R, B, 2], little-endian."""
    return x.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _unhalves(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(b.shape[:-1])


def _crumbs(q: torch.Tensor, bits: int, lanes: int) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., lanes]: element k·lanes + l in bits `bits·k` of byte l."""
    q = q.reshape(*q.shape[:-1], -1, lanes).to(torch.int32)
    shifts = torch.arange(q.shape[-2], dtype=torch.int32).reshape(-1, 1) * bits
    return (q << shifts).sum(dim=-2).to(torch.uint8)


def _uncrumbs(b: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `_crumbs`: uint8 [..., lanes] -> uint8 [..., count·lanes]."""
    shifts = torch.arange(count, dtype=torch.uint8).reshape(-1, 1) * bits
    return ((b.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)).reshape(*b.shape[:-1], -1)


def _pack_scales_k4(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 12 bytes for 8 6-bit scales and mins (the inverse of get_scale_min_k4)."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    low = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    high = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return torch.cat([low, mid, high], dim=-1)


def _unpack_scales_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low, mid, high = b[..., :4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([low & 63, (high & 0xF) | ((low >> 6) << 4)], dim=-1)
    m = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, m


def _pack_scales_q3(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes for 16 6-bit signed scales, stored + 32: low nibbles two to a byte, then
    the high 2 bits four to a byte (quantize_row_q3_K_ref)."""
    u = (sc + 32).to(torch.uint8)
    return torch.cat([_crumbs(u & 0xF, 4, 8), _crumbs(u >> 4, 2, 4)], dim=-1)


def _unpack_scales_q3(b: torch.Tensor) -> torch.Tensor:
    u = _uncrumbs(b[..., :8], 4, 2) | (_uncrumbs(b[..., 8:12], 2, 4) << 4)
    return u.to(torch.int16) - 32


def pack(qtype: str, q_u: torch.Tensor, grid: KGrid) -> torch.Tensor:
    """Levels q_u uint8 [R, C] (C = 256·B) and their grid -> uint8 [R, B·block_bytes]."""
    kind = TYPES[qtype]
    rows, cols = q_u.shape
    q = q_u.reshape(rows, cols // QK_K, QK_K)
    blocks = q.shape[:2]
    sc = grid.sc.reshape(*blocks, kind.subs)
    if qtype == "Q2_K":
        scales = (sc | (grid.m.reshape(*blocks, kind.subs) << 4)).to(torch.uint8)
        parts = [scales, _crumbs(q.reshape(*blocks, 2, 128), 2, 32).flatten(-2), _halves(grid.d), _halves(grid.dmin)]
    elif qtype == "Q3_K":
        hmask = _crumbs(q >> 2, 1, 32)
        qs = _crumbs((q & 3).reshape(*blocks, 2, 128), 2, 32).flatten(-2)
        parts = [hmask, qs, _pack_scales_q3(sc), _halves(grid.d)]
    elif qtype in ("Q4_K", "Q5_K"):
        head = [_halves(grid.d), _halves(grid.dmin), _pack_scales_k4(sc, grid.m.reshape(*blocks, kind.subs))]
        qh = [_crumbs(q >> 4, 1, 32)] if qtype == "Q5_K" else []
        parts = [*head, *qh, _crumbs((q & 0xF).reshape(*blocks, 4, 64), 4, 32).flatten(-2)]
    else:  # Q6_K
        ql = _crumbs((q & 0xF).reshape(*blocks, 2, 128), 4, 64).flatten(-2)
        qh = _crumbs((q >> 4).reshape(*blocks, 2, 128), 2, 32).flatten(-2)
        parts = [ql, qh, sc.to(torch.int8).view(torch.uint8), _halves(grid.d)]
    return torch.cat(parts, dim=-1).reshape(rows, -1)


def unpack(qtype: str, data: torch.Tensor, cols: int) -> tuple[torch.Tensor, KGrid]:
    """Inverse of `pack`: uint8 [R, B·block_bytes] -> (q_u uint8 [R, C], grid)."""
    kind = TYPES[qtype]
    rows = data.shape[0]
    b = data.reshape(rows, cols // QK_K, kind.block_bytes)
    if qtype == "Q2_K":
        scales = b[..., :16]
        q = _uncrumbs(b[..., 16:80].reshape(rows, -1, 2, 32), 2, 4).flatten(-2)
        grid = KGrid(_unhalves(b[..., 80:82]), scales & 0xF, _unhalves(b[..., 82:84]), scales >> 4)
    elif qtype == "Q3_K":
        high = _uncrumbs(b[..., :32], 1, 8)
        low = _uncrumbs(b[..., 32:96].reshape(rows, -1, 2, 32), 2, 4).flatten(-2)
        q = low | (high << 2)
        grid = KGrid(_unhalves(b[..., 108:110]), _unpack_scales_q3(b[..., 96:108]))
    elif qtype in ("Q4_K", "Q5_K"):
        sc, m = _unpack_scales_k4(b[..., 4:16])
        start = 48 if qtype == "Q5_K" else 16
        q = _uncrumbs(b[..., start:].reshape(rows, -1, 4, 32), 4, 2).flatten(-2)
        if qtype == "Q5_K":
            q = q | (_uncrumbs(b[..., 16:48], 1, 8) << 4)
        grid = KGrid(_unhalves(b[..., 0:2]), sc, _unhalves(b[..., 2:4]), m)
    else:  # Q6_K
        low = _uncrumbs(b[..., :128].reshape(rows, -1, 2, 64), 4, 2).flatten(-2)
        high = _uncrumbs(b[..., 128:192].reshape(rows, -1, 2, 32), 2, 4).flatten(-2)
        q = low | (high << 4)
        grid = KGrid(_unhalves(b[..., 208:210]), b[..., 192:208].contiguous().view(torch.int8))
    grid = KGrid(
        grid.d,
        grid.sc.to(torch.int16).reshape(rows, -1),
        grid.dmin,
        None if grid.m is None else grid.m.to(torch.int16).reshape(rows, -1),
    )
    return q.reshape(rows, cols), grid


def dequantize(qtype: str, data: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [R, C], as ggml's dequantize_row_q*_K computes it: (d·sc)·q − dmin·m."""
    kind = TYPES[qtype]
    q_u, grid = unpack(qtype, data, cols)
    rows = q_u.shape[0]
    levels = q_u.reshape(rows, -1, kind.sub).float()
    if kind.symmetric:
        levels = levels - (1 << (kind.bits - 1))
    x = levels * grid.scales().unsqueeze(-1)
    zeros = grid.zeros()
    if zeros is not None:
        x = x + zeros.unsqueeze(-1)
    return x.reshape(rows, cols)
