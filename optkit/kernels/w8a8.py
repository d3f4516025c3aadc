"""W8A8 linear layers: int8 activations × int8 weights → int32, rescaled to float.

y[m, n] = sx[m] · sw[n] · Σ_k qx[m, k] · qw[k, n] + b[n]
with qw = round(W / sw) per output channel (symmetric), and qx = round(x / sx) per token
(dynamic: sx[m] = max_k |x[m, k]| / 127) or per tensor (static: one calibrated sx).
`int8_linear` runs the integer matmul (`torch._int_mm`); `int8_linear_reference` computes the
same quantities in float, for tests and for devices without an int8 matmul. On CUDA, `int8_linear`
runs the Triton kernels instead (optkit/kernels/triton/w8a8.py: quantization, then the int8 matmul
with the scales and bias in its epilogue) when triton imports and no `int_mm` is given. On the CPU
`torch._int_mm` is oneDNN's (VNNI) and wants the weight column-major (`W8A8Linear.prepare`); at 1 to 8
rows on AVX-512 VNNI CPUs, and at any row count on AVX2 ones, optkit's int8 GEMV (cpu_int8_gemv.py)
computes the same int32 result faster, and with dynamic activation scales the whole layer
(quantization, product, rescaling) in one call.
"""

import torch

from optkit.errors import OptkitError, shown_shape
from optkit.kernels import cpu_int8_gemv, huge_pages
from optkit.kernels import triton as triton_kernels  # imports triton only once a CUDA tensor asks

INT8_MAX = 127


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], scale [M, 1] fp32); per token unless a static scale is given."""
    x = x.float()
    if input_scale is None:
        # max |x| per row in one pass (the infinity norm), then as few passes as eager PyTorch allows
        amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True)
        scale = amax.div_(INT8_MAX).clamp_(min=1e-12)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return x.div(scale).round_().clamp_(-INT8_MAX - 1, INT8_MAX).to(torch.int8), scale


def _exact_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 [K, N] -> int32 through float64, which holds every such sum exactly."""
    return (a.double() @ b.double()).to(torch.int32)


def int8_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    *,
    int_mm=None,
    weight_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] float; weight_t int8 [K, N] (the transposed weight); weight_scale [N] fp32.
    `int_mm` is the int8 matmul (default `torch._int_mm`, or optkit's kernel where cpu_int8_gemv.takes
    the rows, the same int32 result, where `weight_sums` (cpu_int8_gemv.weight_sums) is given)."""
    if int_mm is None and triton_kernels.use_triton(x) and weight_t.device == x.device:
        from optkit.kernels.triton import w8a8 as kernels

        return kernels.int8_linear(x, weight_t, weight_scale, bias, input_scale)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if int_mm is None and input_scale is None and weight_sums is not None and cpu_int8_gemv.takes(rows, weight_t):
        # the quantization, the product and the rescaling below, in one C++ call, the same bits
        y = cpu_int8_gemv.int8_linear_dynamic(
            rows.float(), weight_t, weight_sums, weight_scale.float(), None if bias is None else bias.float()
        )
        return y.to(x.dtype).reshape(*shape[:-1], weight_t.shape[1])
    qx, sx = quantize_activations(rows, input_scale)
    if int_mm is None and weight_sums is not None and cpu_int8_gemv.takes(qx, weight_t):
        acc = cpu_int8_gemv.int8_gemv(qx, weight_t, weight_sums)  # int32 [M, N], as _int_mm's
    else:
        acc = (int_mm or torch._int_mm)(qx, weight_t)  # int32 [M, N]
    y = torch.mul(acc, sx).mul_(weight_scale.float())  # int32 * fp32 -> fp32
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).reshape(*shape[:-1], weight_t.shape[1])


def int8_linear_reference(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same computation with the integer matmul done in float64."""
    return int8_linear(x, weight_t, weight_scale, bias, input_scale, int_mm=_exact_int_mm)


def check_scaled_linear(
    weight: torch.Tensor,
    dtype: torch.dtype,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The weight scales as float32 [out] (one per-tensor scale repeated), after checking that the
    tensors of an int8 or FP8 linear agree; an OptkitError naming the tensor otherwise."""
    if weight.dtype != dtype or weight.dim() != 2 or min(weight.shape) < 1:
        raise OptkitError(f"weight is {weight.dtype} {shown_shape(weight)}: a {dtype} [out, in] matrix was expected")
    out_features = weight.shape[0]
    if weight_scale.numel() not in (1, out_features):
        raise OptkitError(
            f"weight_scale is {shown_shape(weight_scale)}: give one scale, or one for each of {out_features} outputs"
        )
    if bias is not None and bias.numel() != out_features:
        raise OptkitError(f"bias is {shown_shape(bias)}, the layer has {out_features} outputs")
    if input_scale is not None and input_scale.numel() != 1:
        raise OptkitError(f"input_scale is {shown_shape(input_scale)}: a static input scale is one value")
    return weight_scale.reshape(-1).float().expand(out_features).contiguous()


class ScaledLinear(torch.nn.Module):
    """An 8-bit linear layer (int8 here, FP8 in fp8.py): its weight in `weight_dtype`, stored as the
    subclass lays it out (`store_weight`), one float32 scale per output, the bias in float32, and a
    static input scale (None: activations quantized per token)."""

    weight_dtype: torch.dtype
    weights_name: str  # for extra_repr: what the weights and the inputs are quantized to
    inputs_name: str

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ):
        super().__init__()
        weight_scale = check_scaled_linear(weight, self.weight_dtype, weight_scale, bias, input_scale)
        self.store_weight(weight)
        self.register_buffer("weight_scale", weight_scale)  # [out]
        self.register_buffer("bias", None if bias is None else bias.float())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.reshape(1).float())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def store_weight(self, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        act = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weights_name} weights, {act} {self.inputs_name} inputs"
        )


class W8A8Linear(ScaledLinear):
    """A linear layer that stays int8 in memory and multiplies in int8."""

    weight_dtype, weights_name, inputs_name = torch.int8, "int8", "int8"
    weight_sums: torch.Tensor | None = None  # each output's weight sum, set by `prepare` where optkit's int8 GEMV runs
    _prepared_for: tuple | None = None  # `_weight_key` when `prepare` last ran

    def store_weight(self, weight: torch.Tensor) -> None:
        # weight: int8 [out, in]; kept transposed, [in, out], row-major: the layout the Triton kernel
        # wants; `prepare` makes it column-major on the CPU, where oneDNN's int8 GEMV is faster so
        self.register_buffer("weight_t", weight.t().contiguous())

    @classmethod
    def concatenate(cls, layers: list["W8A8Linear"]) -> "W8A8Linear | None":
        """One layer computing `layers`' outputs side by side, for linears that read the same input
        (models/fusion.py): the input is quantized once. None unless their static input scales (or
        dynamic) and bias agree. Per-channel weight scales make the result equal to the parts'."""
        first = layers[0]

        def same(m: "W8A8Linear") -> bool:
            scales = (m.input_scale, first.input_scale)
            return (
                type(m) is cls
                and m.in_features == first.in_features
                and (m.bias is None) == (first.bias is None)
                and (scales[0] is None) == (scales[1] is None)
                and (scales[0] is None or torch.equal(*scales))
            )

        if not all(same(m) for m in layers):
            return None
        weight = torch.cat([m.weight_t.t() for m in layers])  # [sum of out, in]
        bias = None if first.bias is None else torch.cat([m.bias for m in layers])
        scale = torch.cat([m.weight_scale for m in layers])
        return cls(weight, scale, bias, first.input_scale)

    def prepare(self) -> None:
        """On the CPU, store weight_t column-major (the same [in, out] values, the storage of [out, in]):
        `torch._int_mm` at one row runs several times faster so (docs/results.md)."""
        if self.weight_t.device.type == "cpu":  # in 2 MiB pages where Linux gives them (kernels/huge_pages.py)
            self.weight_t = huge_pages.copy_in(self.weight_t.t()).t()
        if self.weight_t.device.type == "cpu" and not cpu_int8_gemv.unavailable_reason():
            self.weight_sums = cpu_int8_gemv.weight_sums(self.weight_t)  # not a buffer: derived, CPU only
        self._prepared_for = self._weight_key()

    def _weight_key(self) -> tuple:
        """Changes when weight_t is replaced or written in place (then `prepare` runs again); an
        inference tensor has no version counter (it cannot change outside inference mode)."""
        w = self.weight_t
        return (w.data_ptr(), w.device, None if w.is_inference() else w._version)

    def kernel_for(self, device: torch.device | str, rows: int = 1) -> str:
        """The path `forward` takes on `device`, in words."""
        if torch.device(device).type == "cpu":
            gemv = not cpu_int8_gemv.unavailable_reason()  # max_rows / max_columns exist only then
            if gemv and rows <= cpu_int8_gemv.max_rows() and self.in_features <= cpu_int8_gemv.max_columns():
                return f"{cpu_int8_gemv.name()}, weight column-major"
            return "torch._int_mm (oneDNN int8), weight column-major"
        return "triton int8 matmul" if triton_kernels.use_triton(self.weight_t) else "torch._int_mm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and self._prepared_for != self._weight_key():
            self.prepare()
        return int8_linear(
            x, self.weight_t, self.weight_scale, self.bias, self.input_scale, weight_sums=self.weight_sums
        )
