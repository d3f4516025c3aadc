"""AWQ (Lin et al., 2023): protect the weights that see large activations by scaling them up
before quantization and folding the inverse scale into the operation before them.

For a smoothing group (a norm or linear P feeding linears W_1..W_m, with input X = P(·)):
    Y = W X = (W diag(s)) (diag(s)⁻¹ X)
so W ← W diag(s) and P's output channels ← P / s leave the full-precision function unchanged,
while quantizing W diag(s) rounds the columns of salient input channels more finely. The scale is
s = mean|x|^α (or, "duo scaling", mean|x|^α / mean|ŵ|^(1−α) with ŵ the group-normalised weight
magnitudes), with α chosen on a grid to minimise the block's output error after quantization.
Then each linear's per-group clipping range is shrunk where that lowers its output error (for
asymmetric integers each end of the range on its own).
Pure tensor functions; the search loop that runs modules is in step.py.
"""

import torch

from optkit.quant.methods.rtn.math import k_quantize, minmax_qparams, quantize, quantized_range
from optkit.weights.quantized import dequantize, grouped
from optkit.weights.schemes import WeightScheme
from optkit.weights.stored import k_type


def fake_quantize(w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quantize and dequantize W ([out, in]) with min/max group parameters (a K-quant: its grid)."""
    if k_type(scheme) is not None:
        return k_quantize(w, scheme).dequantize().to(w.device)
    scale, zero_point = minmax_qparams(w, scheme, scale_dtype)
    return dequantize(quantize(w, scale, zero_point, scheme), scale, zero_point, qmin=scheme.qmin)


def activation_magnitude(x: torch.Tensor) -> torch.Tensor:
    """mean |x| per input channel: [..., in] -> [in]. An L1 norm per column: one reduction,
    without the x-sized |x| that abs().mean() would allocate."""
    x = x.reshape(-1, x.shape[-1])
    return torch.linalg.vector_norm(x.float(), ord=1, dim=0) / x.shape[0]


def weight_magnitude(weights: list[torch.Tensor], scheme: WeightScheme) -> torch.Tensor:
    """mean over output rows of |w| / max|w in its group|, per input channel: [in]."""
    w = torch.cat(weights, dim=0).float()
    g = grouped(w.abs(), scheme.group_size_for(w.shape[1]))
    normalised = g / g.amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return normalised.reshape(w.shape).mean(dim=0)


def candidate_scales(x_mag: torch.Tensor, w_mag: torch.Tensor, grid: int = 20, duo: tuple[bool, ...] = (False, True)):
    """Yield (alpha, duo, s) over α ∈ {0, 1/grid, ..., (grid-1)/grid}; s normalised so that
    sqrt(max(s)·min(s)) = 1, as in the reference implementation."""
    for use_duo in duo:
        for step in range(grid):
            alpha = step / grid
            if use_duo:
                s = x_mag.pow(alpha) / (w_mag.pow(1 - alpha) + 1e-4)
            else:
                s = x_mag.pow(alpha)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            yield alpha, use_duo, s


def clip_rows(num_tokens: int, max_tokens: int) -> torch.Tensor:
    """The tokens the clipping search uses: `max_tokens` evenly spaced of `num_tokens` (sorted)."""
    if num_tokens <= max_tokens:
        return torch.arange(num_tokens)
    return torch.linspace(0, num_tokens - 1, max_tokens).long()


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    scheme: WeightScheme,
    *,
    max_shrink: float = 0.5,
    steps: int = 20,
    independent_ends: bool = True,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per (output row, group) clipping range that minimises ‖x wᵀ − x Q(clip(w))ᵀ‖² within the group.

    w: [out, in]; x: [tokens, in], the tokens to measure on (clip_rows picks them). As in the
    reference implementation, ±max|w| is shrunk by the factors 1 − max_shrink · i / steps,
    i = 0..steps. An asymmetric scheme quantizes [min, max] (rtn.quantized_range) rather than
    ±max|w|, so with `independent_ends` each end is shrunk on its own: every
    (lower factor, upper factor) pair of the same grid. Returns [2, out, G]: lower and upper bounds.
    """
    group_size = scheme.group_size_for(w.shape[1])
    w_g = grouped(w.float(), group_size)  # [out, G, gs]
    x_g = x.float().reshape(x.shape[0], -1, group_size)  # [T, G, gs]
    # A group's output error mean_t (x_t · d)² is the quadratic form dᵀ C d with C = XᵀX / T.
    gram = torch.einsum("tgk,tgl->gkl", x_g, x_g) / x.shape[0]  # [G, gs, gs]
    # a K-quant refits its super-blocks' grid for every candidate: its ends shrink together (21, not 441)
    one_bound = scheme.symmetric or not independent_ends or k_type(scheme) is not None
    lower, upper = quantized_range(w_g, symmetric=one_bound)  # [out, G]
    factors = [1 - max_shrink * i / steps for i in range(steps + 1)]
    pairs = [(f, f) for f in factors] if one_bound else [(a, b) for a in factors for b in factors]
    best, best_error = torch.stack([lower, upper]), torch.full_like(upper, float("inf"))
    for lower_factor, upper_factor in pairs:
        bounds = torch.stack([lower * lower_factor, upper * upper_factor])
        clipped = clip(w, bounds)
        d = grouped(fake_quantize(clipped, scheme, scale_dtype), group_size) - w_g  # [out, G, gs]
        d = d.transpose(0, 1)  # [G, out, gs]
        error = (torch.bmm(d, gram) * d).sum(dim=-1).T  # [out, G]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better, bounds, best)
    return best


def clip(w: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Clamp each (row, group) of w ([out, in]) to [lower, upper] (bounds: [2, out, G])."""
    lower, upper = bounds.to(w.dtype).unsqueeze(-1)
    group_size = w.shape[1] // bounds.shape[-1]
    return torch.minimum(torch.maximum(grouped(w, group_size), lower), upper).reshape(w.shape)
