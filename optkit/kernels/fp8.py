"""FP8 W8A8 linear layers (E4M3): float8 activations × float8 weights, rescaled to float.

y[m, n] = sx[m] · sw[n] · Σ_k qx[m, k] · qw[n, k] + b[n]
with qw = fp8(W / sw) per output channel, sw = max_k |W[n, k]| / 448, and qx = fp8(x / sx) per token
(dynamic: sx[m] = max_k |x[m, k]| / 448) or per tensor (static: one calibrated sx). fp8(·) clamps to
±448 (the largest finite E4M3 value) and casts to `torch.float8_e4m3fn`, which rounds to nearest even.

`fp8_linear` is what the runtime and the gate run. On CUDA with compute capability ≥ 8.9 (Ada,
Hopper) it multiplies in FP8 with `torch._scaled_mm` (row-wise scales, bf16 out); everywhere else it
emulates exactly the same quantization: the cast to float8_e4m3fn and back with the same scales, then
a float32 matmul of the (exactly representable) fp8 values. `fp8_linear_reference` is the
straightforward formula in float64: dequantize both operands, multiply.
"""

import functools

import torch

from optkit.kernels.w8a8 import ScaledLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Clamp to the finite E4M3 range and cast (round to nearest even)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], scale [M, 1] fp32); per token unless a static scale is given."""
    x = x.float()
    if input_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return to_fp8(x / scale), scale


def fake_quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 per token (or per tensor with a static scale), dequantized back; keeps x's shape and dtype."""
    q, scale = quantize_activations(x.reshape(-1, x.shape[-1]), input_scale)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_fits(k: int, n: int) -> bool:
    return k % 16 == 0 and n % 16 == 0  # cuBLASLt's FP8 GEMM wants 16-aligned K and N


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    *,
    emulate: bool | None = None,
) -> torch.Tensor:
    """x [..., K] float; weight float8_e4m3fn [N, K]; weight_scale [N] fp32; input_scale [1] or None.
    emulate: None chooses (`torch._scaled_mm` where the device has FP8 tensor cores), True forces
    the emulation (tests compare the two on a GPU)."""
    shape = x.shape
    k, n = shape[-1], weight.shape[0]
    qx, sx = quantize_activations(x.reshape(-1, k), input_scale)
    if emulate is None:
        emulate = not (x.is_cuda and scaled_mm_supported(x.device) and _scaled_mm_fits(k, n))
    if emulate:
        acc = qx.float() @ weight.float().t()  # fp8 values are exact in float32: [M, N]
        y = acc * sx * weight_scale.float()
    else:
        # a row-major [M, K] times a column-major [K, N] (the transpose of the row-major weight)
        y = torch._scaled_mm(
            qx, weight.t(), scale_a=sx, scale_b=weight_scale.float().reshape(1, n), out_dtype=torch.bfloat16
        ).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], n)


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The textbook formula in float64: x̂ = fp8(x / sx) · sx, Ŵ = qw · sw, y = x̂ Ŵᵀ + b."""
    shape = x.shape
    qx, sx = quantize_activations(x.reshape(-1, shape[-1]), input_scale)
    x_hat = qx.double() * sx.double()
    w_hat = weight.double() * weight_scale.double().reshape(-1, 1)
    y = x_hat @ w_hat.t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


class FP8Linear(ScaledLinear):
    """A linear layer that stays float8_e4m3fn in memory and multiplies in FP8 (or emulates it)."""

    weight_dtype, weights_name, inputs_name = FP8_DTYPE, "fp8 e4m3", "fp8"

    def store_weight(self, weight: torch.Tensor) -> None:
        self.register_buffer("weight", weight.contiguous())  # float8_e4m3fn [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.input_scale)
