"""Linear layers over packed integer weights (1-8 bits, per-group scales and zero points): the
weights stay packed in memory; each matmul takes the fastest path the device has, and the reference
dequantizes them on the fly, in the activation dtype.

Storage of q (signed, in [qmin, qmax]) as u = q - qmin, unsigned:
  bits 1..2  int32 [out, ceil(in / 16)]  sixteen 2-bit fields per word, column 16w + j at bits 2j
  bits 3..4  int32 [out, ceil(in / 8)]   eight 4-bit fields per word, column 8w + j at bits 4j
  bits 5..8  int8  [out, in]             q itself
Dequantization: Ŵ[o, i] = (q[o, i] - z[o, g(i)]) · s[o, g(i)], computed in float32 exactly as
`QuantizedWeight.dequantize` does, so the weights (and outputs) match the evaluation loader bit for bit.
On CUDA, `PackedIntLinear.forward` runs the fused Triton W4A16 kernel (optkit/kernels/triton/w4a16.py) when
triton imports and the layer's groups are contiguous (or act-order groups of equal size). On the CPU
it runs optkit's W4A8 kernel (optkit/kernels/cpu_w4a8.py: int8 activations per 32 columns, VNNI or
AVX2 int32 dot products; bits <= 4, groups of 32 columns or a multiple, act-order permuted once) for
every row count, decode and prefill alike; where that kernel cannot build or OPTKIT_CPU_INT4=aten,
PyTorch's int4 kernel (optkit/kernels/cpu_int4.py, bf16 activations) for up to
`cpu_int4.MAX_KERNEL_ROWS` rows; OPTKIT_CPU_INT4=0 the reference. Repacked once (`prepare`, called by
the loader). The dequantize-then-matmul below is the path everywhere else;
`kernel_for` names the path a layer takes. For 4-bit fields without act-order it dequantizes into a
per-thread scratch buffer (`_dequantize_fast`: nibbles split as uint8, then (u + qmin - z) · s in
float32), bit-identical to `dequantize` and much faster (docs/results.md), with no allocation per call.
"""

import functools
import os
import sys
import threading

import torch
import torch.nn.functional as F

from optkit.errors import OptkitError, shown_shape
from optkit.kernels import cpu_int4, cpu_w4a8
from optkit.kernels import triton as triton_kernels  # imports triton only once a CUDA tensor asks
from optkit.weights.packing import field_bits, pack_int32, unpack_int32
from optkit.weights.quantized import QuantizedWeight, dequantize

_scratch_buffers = threading.local()  # per thread: a forward runs its layers one after another
CpuPacked = cpu_int4.Int4Packed | cpu_w4a8.W4A8Packed


@functools.cache
def _aten_chosen() -> bool:
    """OPTKIT_CPU_INT4=aten: PyTorch's int4 kernel (bf16 activations) rather than the W4A8 kernel, for A/B."""
    return os.environ.get("OPTKIT_CPU_INT4", "") == "aten"


def pack_for_cpu(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int, g_idx: torch.Tensor | None
) -> tuple[CpuPacked | str, str]:
    """(the CPU kernel's packed weight, or why none takes it; a note on why the W4A8 kernel does not).
    The W4A8 kernel first, then aten's int4 kernel."""
    note = "OPTKIT_CPU_INT4=aten" if _aten_chosen() else cpu_w4a8.unavailable_reason()
    if not note:
        packed = cpu_w4a8.pack(q, scale, zero_point, bits, g_idx)
        if not isinstance(packed, str):
            return packed, ""
        note = packed
    if not cpu_int4.aten_kernel_exists():
        return f"w4a8: {note}; no int4 kernel in this torch", note
    return cpu_int4.pack(q, scale, zero_point, bits, g_idx), note


def _max_rows(packed: CpuPacked) -> int | None:
    """The most rows the kernel runs (None: all); above them the dequantize path is faster."""
    return cpu_int4.MAX_KERNEL_ROWS if isinstance(packed, cpu_int4.Int4Packed) else cpu_w4a8.MAX_KERNEL_ROWS


def _scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of `numel` elements that every layer this thread runs reuses (grown as needed):
    a fresh multi-MB tensor per call costs page faults and more than the dequantization itself."""
    buf = getattr(_scratch_buffers, name, None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
        buf = torch.empty(numel, dtype=dtype, device=device)
        setattr(_scratch_buffers, name, buf)
    return buf[:numel]


def check_layer_tensors(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    in_features: int,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    """An OptkitError naming the tensor unless they agree: every kernel (Triton's takes N from
    scale.shape[0]) reads qweight, zero_point and bias by the scales' shape without checking it."""
    if not 1 <= bits <= 8 or in_features < 1 or scale.dim() != 2 or min(scale.shape) < 1:
        raise OptkitError(f"w{bits} scales {shown_shape(scale)} for {in_features} inputs: not a quantized linear")
    out_features, groups = scale.shape
    width = field_bits(bits)
    packed = (out_features, in_features if width == 8 else -(-in_features // (32 // width)))
    if tuple(qweight.shape) != packed:
        raise OptkitError(f"qweight is {shown_shape(qweight)}, but the scales and inputs make it {list(packed)}")
    if zero_point.shape != scale.shape:
        raise OptkitError(f"zero_point is {shown_shape(zero_point)}, the scales {shown_shape(scale)}")
    if g_idx is None and in_features % groups:
        raise OptkitError(f"{in_features} inputs are not {groups} whole groups (the scales' columns)")
    if g_idx is not None and g_idx.shape != (in_features,):
        raise OptkitError(f"g_idx is {shown_shape(g_idx)}, not one group per each of {in_features} inputs")
    if g_idx is not None and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise OptkitError(f"g_idx names groups outside the scales' {groups}")
    if bias is not None and bias.shape != (out_features,):
        raise OptkitError(f"bias is {shown_shape(bias)}, the layer has {out_features} outputs")


class PackedIntLinear(torch.nn.Module):
    """y = x Ŵᵀ + b with Ŵ dequantized from packed integers at each call (any of 1..8 bits)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        bits: int,
        in_features: int,
        g_idx: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        check_layer_tensors(qweight, scale, zero_point, bits, in_features, g_idx, bias)
        self.bits, self.in_features, self.out_features = bits, in_features, scale.shape[0]
        self.register_buffer("qweight", qweight)  # packed as in the module docstring
        self.register_buffer("scale", scale)  # [out, G], the stored dtype (the math runs in float32)
        self.register_buffer("zero_point", zero_point.to(torch.int8))  # [out, G]
        self.register_buffer("g_idx", None if g_idx is None else g_idx.to(torch.int32))  # [in]
        self.register_buffer("bias", bias)  # [out], in the activation dtype

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> "PackedIntLinear":
        bits = qw.scheme.bits
        width = field_bits(bits)
        if width == 8:
            qweight = qw.q.to(torch.int8).contiguous()
        else:
            qweight = pack_int32(qw.q.to(torch.int32) - qw.scheme.qmin, width)
        return cls(qweight, qw.scale, qw.zero_point, bits, qw.q.shape[1], qw.g_idx, bias)

    def _layout(self) -> tuple:
        g_idx = None if self.g_idx is None else tuple(self.g_idx.tolist())
        return self.bits, self.in_features, self.scale.shape[1], self.scale.dtype, self.bias is None, g_idx

    @classmethod
    def concatenate(cls, layers: list["PackedIntLinear"]) -> "PackedIntLinear | None":
        """One layer computing `layers`' outputs side by side (their rows stacked), for linears that read
        the same input (models/fusion.py); None unless their bits, groups, act-order and bias agree.
        The storage is per output row, so the rows concatenate as they are."""
        first = layers[0]
        if any(type(m) is not cls or m._layout() != first._layout() for m in layers):
            return None

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(m, name) for m in layers])

        bias = None if first.bias is None else cat("bias")
        return cls(cat("qweight"), cat("scale"), cat("zero_point"), first.bits, first.in_features, first.g_idx, bias)

    def int_weight(self) -> torch.Tensor:
        """The signed integer weight q [out, in] (int32 for packed storage, else int8)."""
        width = field_bits(self.bits)
        if width == 8:
            return self.qweight
        return unpack_int32(self.qweight, width, self.in_features) - (1 << (self.bits - 1))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ [out, in] in `dtype`: the float32 math of `QuantizedWeight.dequantize`, then a cast."""
        return dequantize(self.int_weight(), self.scale, self.zero_point, self.g_idx).to(dtype)

    def _fast_dequantize_terms(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(qmin - z, s), float32 [out, G, 1], when `_dequantize_fast` applies to this layout (4-bit
        fields in whole little-endian words, groups in column order); cached like `cpu_packed`."""
        key = self._buffers_key()
        cached = self.__dict__.get("_fast_terms")
        if cached is None or cached[0] != key:
            fits = (
                field_bits(self.bits) == 4
                and self.g_idx is None
                and self.in_features % 8 == 0
                and self.qweight.is_contiguous()
                and sys.byteorder == "little"
            )
            terms = None
            if fits:
                offset = (-(1 << (self.bits - 1)) - self.zero_point.float()).unsqueeze(-1)  # qmin - z
                terms = (offset, self.scale.float().unsqueeze(-1))
            cached = (key, terms)
            self.__dict__["_fast_terms"] = cached
        return cached[1]

    def _dequantize_fast(self) -> torch.Tensor | None:
        """Ŵ [out, in] in float32, in this thread's scratch buffer (valid until its next call), equal
        to `dequantized_weight()` bit for bit; None where the layout or autograd needs that instead."""
        if torch.is_grad_enabled():
            return None  # autograd would keep a buffer that the next layer overwrites
        terms = self._fast_dequantize_terms()
        if terms is None:
            return None
        offset, scale = terms
        out_features, in_features, device = self.out_features, self.in_features, self.qweight.device
        # byte i of a row holds columns 2i (low nibble) and 2i + 1 (high nibble): u = q - qmin
        packed = self.qweight.view(torch.uint8)  # [out, in / 2]
        low = _scratch("low", packed.numel(), torch.uint8, device).view_as(packed)
        high = _scratch("high", packed.numel(), torch.uint8, device).view_as(packed)
        torch.bitwise_and(packed, 15, out=low)
        torch.bitwise_right_shift(packed, 4, out=high)
        u = _scratch("u", out_features * in_features, torch.uint8, device).view(out_features, in_features // 2, 2)
        torch.stack((low, high), dim=-1, out=u)
        groups = scale.shape[1]
        weight = _scratch("weight", u.numel(), torch.float32, device).view(out_features, groups, -1)
        weight.copy_(u.view(out_features, groups, -1))
        # (u + (qmin - z)) · s: u + qmin - z is a small integer, exact in float32, so this is
        # dequantize()'s (q - z) · s to the bit
        weight.add_(offset).mul_(scale)
        return weight.view(out_features, in_features)

    def keep_dequantized(self, dtype: torch.dtype = torch.float32) -> None:
        """Hold Ŵ in `dtype` for inputs over the kernel's rows (an evaluation's long windows): the
        memory of a full-precision layer, for no dequantization per call. Dropped if a buffer changes.
        Nothing to hold where the CPU's W4A8 kernel takes every row count."""
        packed = self.cpu_packed()  # a reason, not a layout, off the CPU or with OPTKIT_CPU_INT4=0
        if isinstance(packed, cpu_w4a8.W4A8Packed) and _max_rows(packed) is None:
            return
        self.__dict__["_kept"] = (self._buffers_key(), self.dequantized_weight(dtype))

    def _buffers_key(self) -> tuple:
        """Changes when a buffer is replaced or modified in place. From the buffers dict, not
        Module.__getattr__: this runs at every call and must cost ~1 µs."""
        b = self._buffers
        # inference tensors have no version counter (they cannot change outside inference mode)
        return tuple(
            None if t is None else (id(t), t.data_ptr(), None if t.is_inference() else t._version)
            for t in (b["qweight"], b["scale"], b["zero_point"], b["g_idx"])
        )

    def cpu_packed(self) -> CpuPacked | str:
        """The CPU kernel's layout of this layer (`pack_for_cpu`), packed once and cached until its
        buffers change; or why no kernel takes it."""
        if not cpu_int4.available():
            return "OPTKIT_CPU_INT4=0"
        return self._cpu_packing()[0]

    def _cpu_packing(self) -> tuple[CpuPacked | str, str]:
        key = self._buffers_key()
        cached = self.__dict__.get("_cpu_int4")
        if cached is None or cached[0] != key:
            if self.qweight.device.type != "cpu":
                return "not on the CPU", ""
            cached = (key, pack_for_cpu(self.int_weight(), self.scale, self.zero_point, self.bits, self.g_idx))
            self.__dict__["_cpu_int4"] = cached
        return cached[1]

    def prepare(self) -> None:
        """Repack for this device's kernel now (load time) rather than at the first call."""
        if self.qweight.device.type == "cpu":
            self.cpu_packed()

    def kernel_for(self, device: torch.device | str, rows: int = 1) -> str:
        """The path `forward` takes for `rows` rows of input on `device`, in words."""
        if torch.device(device).type == "cpu":
            packed = self.cpu_packed()
            if isinstance(packed, str):
                return f"dequantize+matmul ({packed})"
            limit = _max_rows(packed)
            if limit is not None and rows > limit:
                return f"dequantize+matmul (over {limit} rows)"
            if isinstance(packed, cpu_w4a8.W4A8Packed):
                return cpu_w4a8.name()
            return f"{cpu_int4.NAME} (w4a8: {self._cpu_packing()[1]})"
        return "triton w4a16 or dequantize+matmul"

    def w4a8_for(self, x: torch.Tensor) -> cpu_w4a8.W4A8Packed | None:
        """The W4A8 layout `forward` runs `x` through in one kernel call (on the CPU, no act-order
        permutation: the layout a fused decode layer can take, kernels/cpu_decode.py); None elsewhere."""
        if x.device.type != "cpu":
            return None
        packed = self.cpu_packed()
        if not isinstance(packed, cpu_w4a8.W4A8Packed) or packed.perm is not None:
            return None
        limit = cpu_w4a8.MAX_KERNEL_ROWS
        return packed if limit is None or x.numel() <= limit * self.in_features else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = triton_kernels.packed_linear(self, x, bias)
        if y is not None:
            return y
        if x.device.type == "cpu":
            packed = self.cpu_packed()
            if isinstance(packed, cpu_w4a8.W4A8Packed):
                limit = cpu_w4a8.MAX_KERNEL_ROWS
                if limit is None or x.numel() <= limit * self.in_features:
                    return cpu_w4a8.w4a8_linear(x, packed, bias)
            elif not isinstance(packed, str) and x.numel() <= cpu_int4.MAX_KERNEL_ROWS * self.in_features:
                return cpu_int4.int4_linear(x, packed, bias)
        kept = self.__dict__.get("_kept")
        if kept is not None and kept[1].dtype == x.dtype and kept[0] == self._buffers_key():
            return F.linear(x, kept[1], bias)
        weight = self._dequantize_fast()
        if weight is None:
            weight = self.dequantized_weight(x.dtype)
        return F.linear(x, weight.to(x.dtype), bias)

    def extra_repr(self) -> str:
        groups = self.scale.shape[1]
        order = ", act-order g_idx" if self.g_idx is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, w{self.bits}, {groups} groups{order}"
