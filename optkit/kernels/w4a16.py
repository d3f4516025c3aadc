"""Weight-only quantized linear layers: integer weights stay packed in memory and are dequantized
on the fly, in the activation dtype, for each matmul (the reference kernel).

Storage of q (signed, in [qmin, qmax]) as u = q - qmin, unsigned:
  bits 1..2  int32 [out, ceil(in / 16)]  sixteen 2-bit fields per word, column 16w + j at bits 2j
  bits 3..4  int32 [out, ceil(in / 8)]   eight 4-bit fields per word, column 8w + j at bits 4j
  bits 5..8  int8  [out, in]             q itself
Dequantization: Ŵ[o, i] = (q[o, i] - z[o, g(i)]) · s[o, g(i)], computed in float32 exactly as
`QuantizedWeight.dequantize` does, so the weights (and outputs) match the evaluation loader bit for bit.
On CUDA, `W4A16Linear.forward` runs the fused Triton kernel (optkit/kernels/triton/w4a16.py) when
triton imports and the layer's groups are contiguous (or act-order groups of equal size). On the CPU
it runs PyTorch's int4 kernel (optkit/kernels/cpu_int4.py: bits <= 4, groups of 32 columns or a
multiple, act-order permuted once) for up to `cpu_int4.MAX_KERNEL_ROWS` rows, repacked once
(`prepare`, called by the loader). The dequantize-then-matmul below is the path everywhere else;
`kernel_for` names the path a layer takes.
"""

import torch
import torch.nn.functional as F

from optkit.kernels import cpu_int4
from optkit.kernels import triton as triton_kernels  # imports triton only once a CUDA tensor asks
from optkit.weights.packing import field_bits, pack_int32, unpack_int32
from optkit.weights.quantized import QuantizedWeight, dequantize


class W4A16Linear(torch.nn.Module):
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
        self.bits, self.in_features, self.out_features = bits, in_features, scale.shape[0]
        self.register_buffer("qweight", qweight)  # packed as in the module docstring
        self.register_buffer("scale", scale)  # [out, G], the stored dtype (the math runs in float32)
        self.register_buffer("zero_point", zero_point.to(torch.int8))  # [out, G]
        self.register_buffer("g_idx", None if g_idx is None else g_idx.to(torch.int32))  # [in]
        self.register_buffer("bias", bias)  # [out], in the activation dtype

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> "W4A16Linear":
        bits = qw.scheme.bits
        width = field_bits(bits)
        if width == 8:
            qweight = qw.q.to(torch.int8).contiguous()
        else:
            qweight = pack_int32(qw.q.to(torch.int64) - qw.scheme.qmin, width)
        return cls(qweight, qw.scale, qw.zero_point, bits, qw.q.shape[1], qw.g_idx, bias)

    def int_weight(self) -> torch.Tensor:
        """The signed integer weight q [out, in] (int32 for packed storage, else int8)."""
        width = field_bits(self.bits)
        if width == 8:
            return self.qweight
        return unpack_int32(self.qweight, width, self.in_features) - (1 << (self.bits - 1))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ [out, in] in `dtype`: the float32 math of `QuantizedWeight.dequantize`, then a cast."""
        return dequantize(self.int_weight(), self.scale, self.zero_point, self.g_idx).to(dtype)

    def cpu_packed(self) -> cpu_int4.Int4Packed | str:
        """The CPU int4 kernel's layout of this layer, packed once and cached until its buffers change;
        or why the kernel cannot take it."""
        if not cpu_int4.available():
            return "OPTKIT_CPU_INT4=0 or no int4 kernel in this torch"
        b = self._buffers  # not Module.__getattr__: this runs at every call, the key must cost ~1 µs
        # inference tensors have no version counter (they cannot change outside inference mode)
        key = tuple(
            None if t is None else (id(t), t.data_ptr(), None if t.is_inference() else t._version)
            for t in (b["qweight"], b["scale"], b["zero_point"], b["g_idx"])
        )
        cached = self.__dict__.get("_cpu_int4")
        if cached is None or cached[0] != key:
            if self.qweight.device.type != "cpu":
                return "not on the CPU"
            packed = cpu_int4.pack(self.int_weight(), self.scale, self.zero_point, self.bits, self.g_idx)
            cached = (key, packed)
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
            if rows > cpu_int4.MAX_KERNEL_ROWS:
                return f"dequantize+matmul (over {cpu_int4.MAX_KERNEL_ROWS} rows)"
            return cpu_int4.NAME
        return "triton w4a16 or dequantize+matmul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if triton_kernels.use_triton(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
            from optkit.kernels.triton import w4a16 as kernels

            packed = kernels.packed_for(self)  # None when the layout needs the reference path
            if packed is not None:
                return kernels.w4a16_linear(x, packed, bias)
        elif x.device.type == "cpu" and x.numel() <= cpu_int4.MAX_KERNEL_ROWS * self.in_features:
            packed = self.cpu_packed()
            if not isinstance(packed, str):
                return cpu_int4.int4_linear(x, packed, bias)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        groups = self.scale.shape[1]
        order = ", act-order g_idx" if self.g_idx is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, w{self.bits}, {groups} groups{order}"
