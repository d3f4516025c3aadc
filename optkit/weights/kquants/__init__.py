"""ggml's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): 256-column super-blocks, bit-exact with
ggml-common.h (layout.py), their grids fitted as llama.cpp does (fit.py, search.py).

How a caller gives one layer a K type: the format's scheme for it is
`weights.stored.k_scheme(qtype)` (a StoredScheme with `gguf_type` set; `formats/gguf.constrain`
builds it from a recipe's scheme and a type), and every method quantizes onto the K grid of the
scheme it is handed. The layer's width must be a multiple of 256 (QK_K).

In optkit's terms a K-quant is a QuantizedWeight with group_size = the sub-block (16 or 32), float32
scales d·sc_j, float32 zero points −dmin·m_j (Q2_K/Q4_K/Q5_K, a float zero: x = (q − qmin)·s + z)
or integer zeros (Q3_K/Q6_K: x = q·s), q = q_u − 2^(bits−1), and the KGrid kept in `grid` for the
writer: its dequantization is ggml's, bit for bit.
"""

import torch

from optkit.errors import OptkitError
from optkit.weights.kquants import layout
from optkit.weights.kquants.fit import fit_grid, round_levels
from optkit.weights.kquants.layout import QK_K, TYPES, KGrid
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme

K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
__all__ = ["K_TYPES", "QK_K", "TYPES", "KGrid", "block_bytes", "dequantize_rows", "fit_grid", "pack"]
__all__ += ["quantize_levels", "levels", "quantize_rows", "quantized_weight", "round_levels", "unpack"]


def block_bytes(qtype: str) -> int:
    return TYPES[qtype].block_bytes


def check_weight(weight: torch.Tensor, qtype: str, name: str = "a weight") -> None:
    """One line for what a K-quant cannot hold: a width not in whole super-blocks, NaN or inf."""
    if weight.dim() != 2 or weight.shape[1] % QK_K:
        raise OptkitError(
            f"{name} ({'×'.join(map(str, weight.shape))}): {qtype} stores rows in super-blocks of {QK_K} columns: "
            "use a legacy type (Q4_0, Q8_0) for it"
        )
    if not torch.isfinite(weight).all():
        raise OptkitError(f"{name}: the weight contains NaN or inf: repair the checkpoint before quantizing")


def quantize_levels(
    weight: torch.Tensor, qtype: str, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, KGrid]:
    """(levels q_u uint8 [R, C], grid): the grid fitted to the weight, each weight rounded onto it."""
    check_weight(weight, qtype)
    grid = fit_grid(weight, qtype, importance)
    return round_levels(weight, grid, qtype), grid


def quantize_rows(
    weight: torch.Tensor, qtype: str, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw uint8 [R, C/256·block_bytes], the float32 weight those bytes dequantize to)."""
    q_u, grid = quantize_levels(weight, qtype, importance)
    raw = layout.pack(qtype, q_u.cpu(), _cpu(grid))
    return raw, layout.dequantize(qtype, raw, weight.shape[1])


def dequantize_rows(raw: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    return layout.dequantize(qtype, raw, cols)


def pack(qtype: str, q_u: torch.Tensor, grid: KGrid) -> torch.Tensor:
    return layout.pack(qtype, q_u.cpu(), _cpu(grid))


def unpack(qtype: str, raw: torch.Tensor, cols: int) -> tuple[torch.Tensor, KGrid]:
    return layout.unpack(qtype, raw, cols)


def quantized_weight(q_u: torch.Tensor, grid: KGrid, scheme: WeightScheme) -> QuantizedWeight:
    """Levels q_u [out, in] on a K grid as a QuantizedWeight: q = q_u + qmin, scales d·sc_j, zero
    points −dmin·m_j (or integer zeros for Q3_K/Q6_K); it dequantizes as ggml does, bit for bit."""
    q = (q_u.to(torch.int16) + scheme.qmin).to(torch.int8)
    zeros, scale = grid.zeros(), grid.scales()
    zero_point = zeros if zeros is not None else torch.zeros(scale.shape, dtype=torch.int8)
    return QuantizedWeight(q.cpu(), scale.cpu(), zero_point.cpu(), scheme, grid=_cpu(grid))


def levels(qw: QuantizedWeight) -> torch.Tensor:
    """The stored levels q_u (uint8) of a K-quant QuantizedWeight."""
    return (qw.q.to(torch.int16) - qw.scheme.qmin).to(torch.uint8)


def _cpu(grid: KGrid) -> KGrid:
    return KGrid(*(None if t is None else t.cpu() for t in (grid.d, grid.sc, grid.dmin, grid.m)))
