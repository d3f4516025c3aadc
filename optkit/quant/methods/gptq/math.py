"""GPTQ (Frantar et al., 2022): quantize W column by column, pushing each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer loss.

Layer objective, for calibration inputs X ([in, tokens]):  min_Ŵ ‖WX − ŴX‖².
Its Hessian is H = 2XXᵀ ([in, in]), kept here as a running average over tokens.
After quantizing column i to q_i, the optimal update of the remaining columns F is
    δ_F = −(w_i − q_i) / [H⁻¹]_ii · [H⁻¹]_{i,F}                       (paper, eq. 3)
and with the upper Cholesky factor U of H⁻¹ this becomes row i of U (eq. 4–5), which lets
the updates be applied lazily, one block of columns at a time (the paper's §"Lazy batch").
Pure tensor functions: no modules, hooks or I/O.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from optkit.errors import OptkitError
from optkit.quant.methods.gptq.kgrid import SuperBlockGrids
from optkit.quant.methods.gptq.options import GPTQOptions
from optkit.quant.methods.rtn.math import from_grid, minmax_qparams, round_to_grid, signed_max_qparams
from optkit.weights.kquants import QK_K
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme
from optkit.weights.stored import has_float_zero, k_type

QPARAMS = {"minmax": minmax_qparams, "signed_max": signed_max_qparams}


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    loss: float  # mean over calibration tokens of ‖(W − Ŵ)x‖²
    damp: float  # the dampening fraction finally used


def all_finite(x: torch.Tensor) -> bool:
    """torch.isfinite(x).all() without its temporaries (|x| and two masks, 1.5× the size of x):
    min and max propagate NaN, so both are finite exactly when every element is."""
    if x.numel() == 0:
        return True
    if x.ndim >= 2 and x.mT.is_contiguous():
        x = x.mT  # the same elements; a reduction over a column-major matrix would copy it first
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def empty_hessian(in_features: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    return torch.zeros(in_features, in_features, dtype=torch.float32, device=device), 0


def accumulate_hessian(
    hessian: torch.Tensor, num_tokens: int, x: torch.Tensor, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """Fold a batch of inputs x ([..., in]) into the running average H = 2/N Σ x xᵀ, or with
    `weight` (one c_t ≥ 0 per token of x) H = 2/N Σ c_t x xᵀ, the Hessian of Σ c_t ‖ΔW x_t‖²."""
    x = x.reshape(-1, x.shape[-1]).to(hessian.device, torch.float32)
    new_total = num_tokens + x.shape[0]
    hessian.mul_(num_tokens / new_total)
    weighted = x if weight is None else x * weight.reshape(-1, 1).to(x.device, torch.float32)
    hessian.addmm_(x.T, weighted, alpha=2.0 / new_total)
    return hessian, new_total


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(Δ H Δᵀ) / 2 with Δ = W − Ŵ: the mean over tokens of ‖Δx‖²."""
    delta = (w.float() - w_hat.float()).to(hessian.device)
    return (delta @ hessian).mul_(delta).sum().item() / 2


def working_hessian(hessian: torch.Tensor, perm: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """P H Pᵀ (columns in processing order) with H_ii = 1 for dead inputs, as a new [in, in]
    matrix laid out column-major: LAPACK factorizes and inverts column-major matrices in place,
    so the three steps of `inverse_hessian_factor` then all work in this one buffer (a row-major
    input costs a temporary copy per step)."""
    H = hessian.mT[perm[:, None], perm].mT  # H[i, j] = hessian[perm[i], perm[j]]
    H.diagonal()[dead[perm]] = 1
    return H


def inverse_hessian_factor(
    hessian: torch.Tensor, perm: torch.Tensor, dead: torch.Tensor, damp: float, options: GPTQOptions, name: str
) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H' + λI)⁻¹, H' = working_hessian(hessian, perm, dead) and
    λ = damp · mean(diag H'); raise λ on failure. `hessian` is left as it is.

    The factor overwrites H' in place; a failed attempt rebuilds H' and adds the dampening
    increments applied so far again, so a retry sees the same numbers as one that had kept H'."""
    increments: list[float] = []
    applied, mean_diag = 0.0, None
    info = torch.zeros((), dtype=torch.int32, device=hessian.device)
    for attempt in range(options.max_damp_retries + 1):
        factor = working_hessian(hessian, perm, dead)
        if mean_diag is None:
            mean_diag = torch.mean(torch.diag(factor)).item()
        increments.append((damp - applied) * mean_diag)
        applied = damp
        for increment in increments:
            factor.diagonal().add_(increment)
        torch.linalg.cholesky_ex(factor, out=(factor, info))  # H' + λI = L Lᵀ
        if info == 0:  # (H' + λI)⁻¹ from L, then its upper factor U: (H' + λI)⁻¹ = Uᵀ U
            torch.cholesky_inverse(factor, out=factor)
            torch.linalg.cholesky_ex(factor, upper=True, out=(factor, info))
        if info == 0 and all_finite(factor):
            if attempt:
                warnings.warn(
                    f"{name}: Hessian not positive definite; GPTQ used dampening {damp:g} instead of {options.damp:g}",
                    stacklevel=2,
                )
            return factor, damp
        del factor
        tried, damp = damp, damp * 10 if damp > 0 else 1e-3
    raise OptkitError(
        f"{name}: the Hessian stays singular even with dampening {tried:g}: "
        "use more calibration samples (--num-samples) or a larger --damp"
    )


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scheme: WeightScheme,
    options: GPTQOptions = GPTQOptions(),
    *,
    scale_dtype: torch.dtype | None = None,
    name: str = "layer",
) -> GPTQResult:
    """Quantize W ([out, in]) with H ([in, in]); returns integers, scales, zero points, g_idx, loss.
    Scales are rounded to `scale_dtype` (None: the scheme's rule for W's dtype). A K-quant scheme's
    grid is fitted per super-block (kgrid.py)."""
    if not all_finite(w):
        raise OptkitError(f"{name}: the weight contains NaN or inf: repair the checkpoint before quantizing")
    if not all_finite(hessian):
        raise OptkitError(f"{name}: the calibration activations contain NaN or inf: check the model and --calib data")
    out_features, in_features = w.shape
    group_size = scheme.group_size_for(in_features)
    num_groups = in_features // group_size
    scale_dtype = scheme.scale_dtype_for(w.dtype) if scale_dtype is None else scale_dtype
    w_orig = w.float().to(hessian.device)
    W = w_orig.clone()

    diag = torch.diag(hessian)
    dead = diag == 0  # inputs that were always zero: their weights cannot matter
    W[:, dead] = 0

    # Group parameters fixed up front from the unpermuted weight (static groups, or per channel).
    qparams = QPARAMS[options.scale or "minmax"] if scheme.symmetric else minmax_qparams
    grids = SuperBlockGrids(k_type(scheme), diag) if k_type(scheme) is not None else None
    fit = grids.fit if grids is not None else lambda w, _: qparams(w, scheme, scale_dtype)
    fit_width = QK_K if grids is not None else group_size  # the columns whose parameters are fitted together
    fixed_params = None
    if options.static_groups or group_size == in_features or (grids is not None and options.act_order):
        fixed_params = fit(W, 0)

    perm = torch.arange(in_features, device=W.device)
    if options.act_order:
        perm = torch.argsort(diag.masked_fill(dead, 1), descending=True)
        W = W[:, perm]

    # Working memory beyond W: this one [in, in] factor (the caller's Hessian is only read).
    Hinv, damp = inverse_hessian_factor(hessian, perm, dead, options.damp, options, name)

    # Group of each *permuted* position: contiguous runs in processing order, unless static.
    if fixed_params is not None:
        group_of_position = perm // group_size
    else:
        group_of_position = torch.arange(in_features, device=W.device) // group_size
    zero_dtype = scale_dtype if has_float_zero(scheme) else torch.int8
    scale = torch.empty(out_features, num_groups, dtype=scale_dtype, device=W.device)
    zero_point = torch.zeros(out_features, num_groups, dtype=zero_dtype, device=W.device)
    if fixed_params is not None:
        scale[:], zero_point[:] = fixed_params
    # Blocks never straddle a group, so each group's parameters come from up-to-date weights.
    block_size = max(options.block_size, fit_width) if fixed_params is None else options.block_size
    if fixed_params is None and block_size % fit_width:
        block_size = fit_width * max(1, block_size // fit_width)
    columns = _Columns(scheme, fit, fit_width, group_of_position, fixed_params is None)
    Q = columns.quantize(W, Hinv, scale, zero_point, block_size)
    del W, Hinv  # free the factor and the working weights before the loss below

    inverse = torch.argsort(perm)
    q_int = Q[:, inverse]
    del Q
    g_idx = group_of_position[inverse].to(torch.int32)
    contiguous = torch.equal(g_idx, torch.arange(in_features, device=g_idx.device, dtype=torch.int32) // group_size)
    result = QuantizedWeight(q_int.cpu(), scale.cpu(), zero_point.cpu(), scheme, None if contiguous else g_idx.cpu())
    result.grid = grids.grid() if grids is not None else None
    return GPTQResult(result, output_error(w_orig, result.dequantize().to(hessian.device), hessian), damp)


@dataclass(frozen=True)
class _Columns:
    """GPTQ's column loop over one weight: how each column is rounded and where its group's
    parameters come from (chosen at the group's first column unless fixed up front). `fit`
    (weights [out, fit_width], first column) -> (scales, zero points) [out, fit_width / group_size]:
    one group's, or a K-quant super-block's sub-blocks."""

    scheme: WeightScheme
    fit: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    fit_width: int
    group_of_position: torch.Tensor
    groups_as_they_come: bool

    def quantize(
        self, W: torch.Tensor, Hinv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """The integers of W ([out, in], columns in processing order, updated in place), block by
        block with the upper factor Hinv of (H + λI)⁻¹; fills `scale` and `zero_point` as it goes."""
        scheme = self.scheme
        Q = torch.zeros_like(W, dtype=torch.int8)
        in_features = W.shape[1]
        for i1 in range(0, in_features, block_size):
            i2 = min(i1 + block_size, in_features)
            W1 = W[:, i1:i2].clone()  # [out, B]
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]  # [B, B]
            for i in range(i2 - i1):
                column = i1 + i
                g = self.group_of_position[column]
                if self.groups_as_they_come and column % self.fit_width == 0:
                    s, z = self.fit(W1[:, i : i + self.fit_width], column)
                    scale[:, g : g + s.shape[1]], zero_point[:, g : g + s.shape[1]] = s, z
                s, z = scale[:, g], zero_point[:, g]
                q = round_to_grid(W1[:, i], s, z, scheme)
                Q[:, column] = q.to(torch.int8)
                err = (W1[:, i] - from_grid(q, s, z, scheme)) / Hinv1[i, i]
                W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)  # eq. 3 within the block
                Err1[:, i] = err
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # the block's deferred update of all later columns
        return Q
