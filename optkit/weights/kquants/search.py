"""The sub-scale searches of llama.cpp's K-quant quantizers (ggml/src/ggml-quants.c), vectorised
over many groups at once. Each takes groups x [N, n] and per-weight importances w [N, n] (≥ 0) and
minimises the weighted squared error Σ w·(x − x̂)² over a small set of candidate scales.

- `affine_levels` (make_qkx2_quants / make_qkx3_quants): x̂ = scale·L − min_, L in 0..nmax; tries
  iscale = (nmax + rmin + rdelta·i) / (max − min) and fits (scale, min) by weighted least squares
  for each candidate's levels.
- `signed_levels` (make_qx_quants, rmse_type 1): x̂ = scale·L, L in −nmax..nmax−1, anchored on
  the value of largest magnitude; iscale = −(nmax + 0.1·i) / max for i in −9..9, scale by least squares.
- `positive_levels` (make_qp_quants): x ≥ 0 (sub-scales, sub-minimums) on x̂ = scale·L, L in 0..nmax,
  then up to 5 passes of coordinate descent on single levels.
ggml's nearest_int rounds half to even, as torch.round does.
"""

import torch

GROUP_MAX_EPS = 1e-15  # ggml-quants.c: a group below it is all zero


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


def affine_levels(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [N], min_ [N] ≥ 0) with x ≈ scale·L − min_ (make_qkx3_quants with given weights).
    A candidate's error Σw(s·L + o − x)² is expanded into the sums the fit already has (in float64)."""
    low = x.amin(dim=-1).clamp(max=0)
    span = x.amax(dim=-1) - low
    flat = span <= 0
    span = torch.where(flat, torch.ones_like(span), span)
    shifted = x - low.unsqueeze(-1)
    sum_w, sum_x, sum_x2 = w.sum(-1).double(), (w * x).sum(-1).double(), (w * x * x).sum(-1).double()

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        L = torch.round(iscale.unsqueeze(-1) * shifted).clamp_(0, nmax)
        wL = w * L
        return wL.sum(-1).double(), (wL * L).sum(-1).double(), (wL * x).sum(-1).double()

    def error(scale, offset, sum_l, sum_l2, sum_xl) -> torch.Tensor:
        return (
            scale * scale * sum_l2 + 2 * scale * offset * sum_l - 2 * scale * sum_xl
            + offset * offset * sum_w - 2 * offset * sum_x + sum_x2
        )  # fmt: skip

    scale, offset = (span / nmax).double(), low.double()
    best = error(scale, offset, *fit(nmax / span))
    for step in range(nstep + 1):
        sum_l, sum_l2, sum_xl = fit((rmin + rdelta * step + nmax) / span)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = _safe_div(sum_w * sum_xl - sum_x * sum_l, D)
        this_offset = _safe_div(sum_l2 * sum_x - sum_l * sum_xl, D)
        positive = this_offset > 0  # the grid must reach down to 0: offset 0, scale refitted
        this_offset = torch.where(positive, 0.0, this_offset)
        this_scale = torch.where(positive, _safe_div(sum_xl, sum_l2), this_scale)
        cur = error(this_scale, this_offset, sum_l, sum_l2, sum_xl)
        better = (D > 0) & (cur < best)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        offset = torch.where(better, this_offset, offset)
    scale = torch.where(flat, 0.0, scale)
    return scale.float(), -offset.float()


def signed_levels(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [N], L [N, n]) with x ≈ scale·L, L in −nmax..nmax−1 (make_qx_quants, rmse_type 1);
    scale 0 for an all-zero group."""
    peak = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    zero = peak.abs() < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    scale = best = levels = None
    for step in [0, *range(-9, 0), *range(1, 10)]:
        iscale = -(nmax + 0.1 * step) / peak
        L = torch.round(iscale.unsqueeze(-1) * x).clamp(-nmax, nmax - 1)
        sum_lx, sum_l2 = (w * x * L).sum(-1), (w * L * L).sum(-1)
        this_scale = _safe_div(sum_lx, sum_l2)
        if scale is None:
            scale, best, levels = this_scale, this_scale * sum_lx, L
            continue
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = torch.where(better, this_scale, scale)
        best = torch.where(better, this_scale * sum_lx, best)
        levels = torch.where(better.unsqueeze(-1), L, levels)
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(zero.unsqueeze(-1), 0, levels)


def positive_levels(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [N], L [N, n] in 0..nmax) with x ≈ scale·L for x ≥ 0 (make_qp_quants)."""
    peak = x.amax(dim=-1)
    zero = peak < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)

    def mse(iscale: torch.Tensor) -> torch.Tensor:
        L = torch.round(iscale.unsqueeze(-1) * x).clamp(max=nmax)
        return (w * (x - L / iscale.unsqueeze(-1)).pow(2)).sum(-1)

    iscale = nmax / peak
    best = mse(iscale)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        candidate = (0.1 * step + nmax) / peak
        error = mse(candidate)
        better = error < best
        best, iscale = torch.where(better, error, best), torch.where(better, candidate, iscale)
    L = torch.round(iscale.unsqueeze(-1) * x).clamp(0, nmax)
    sum_lx, sum_l2 = (w * x * L).sum(-1), (w * L * L).sum(-1)
    for _ in range(5):  # move one level at a time while Σ(w·x·L)² / Σ(w·L²) grows
        changed = False
        for i in range(x.shape[-1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx, sl2 = sum_lx - wi * xi * li, sum_l2 - wi * li * li
            usable = (slx > 0) & (sl2 > 0)
            new = torch.round(xi * _safe_div(sl2, slx)).clamp(0, nmax)
            slx_new, sl2_new = slx + wi * xi * new, sl2 + wi * new * new
            take = usable & (new != li) & (slx_new * slx_new * sum_l2 > sum_lx * sum_lx * sl2_new)
            if take.any():
                changed = True
                L[:, i] = torch.where(take, new, li)
                sum_lx, sum_l2 = torch.where(take, slx_new, sum_lx), torch.where(take, sl2_new, sum_l2)
        if not changed:
            break
    scale = torch.where(zero, torch.zeros_like(peak), _safe_div(sum_lx, sum_l2))
    return scale, torch.where(zero.unsqueeze(-1), torch.zeros_like(L), L)
