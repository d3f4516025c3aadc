"""What a quantization scheme is: bits, group size, symmetry. Field names are the recipe keys."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from optkit.errors import OptkitError

SUPPORTED_BITS = (2, 3, 4, 8)


class WeightScheme(BaseModel):
    """Integer weight quantization, one scale (and zero point) per `group_size` input columns.

    group_size -1 means one group per output channel. Integers are signed, as compressed-tensors
    stores them: q in [-2^(bits-1), 2^(bits-1) - 1], w ≈ (q - zero_point) * scale.
    type "float": q is float8_e4m3fn (FP8, 8 bits per output channel), w ≈ q * scale.
    type "nf4": q is an index 0..15 into the NormalFloat code book (weights/codebooks.py), w ≈ NF4[q] * absmax
    of its block of `group_size` columns. Written only when not "int", so integer schemes dump as before.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    type: Literal["int", "float", "nf4"] = Field("int", exclude_if=lambda t: t == "int")
    double_quant: bool = Field(False, exclude_if=lambda d: not d)  # nf4: block scales stored in 8 bits
    # the dtype scales are rounded to and stored in; "auto": `scale_dtype_for`'s rule
    scale_dtype: Literal["auto", "float16", "bfloat16"] = Field("auto", exclude_if=lambda d: d == "auto")

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int) -> int:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
        return bits

    @field_validator("group_size")
    @classmethod
    def _group_size_positive(cls, group_size: int) -> int:
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"group_size must be positive or -1 (per channel), got {group_size}")
        return group_size

    @model_validator(mode="after")
    def _type_fits(self):
        if self.type == "float" and (self.bits, self.group_size, self.symmetric) != (8, -1, True):
            raise ValueError("type float (FP8 E4M3) is 8 bits per output channel, symmetric: bits 8, group_size -1")
        if self.type == "nf4" and (self.bits != 4 or not self.symmetric or self.group_size == -1):
            raise ValueError("type nf4 is 4 bits, symmetric (absmax), in blocks: bits 4 and a positive group_size")
        if self.double_quant and self.type != "nf4":
            raise ValueError("double_quant quantizes NF4's block scales: use it with type nf4")
        return self

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def scale_dtype_for(self, weight_dtype):
        """The dtype of the scales of a weight quantized in `weight_dtype` (a torch.dtype): the
        scheme's `scale_dtype`, or for "auto" the weight's own half dtype, bfloat16 for any other.
        A data-free method reads the checkpoint's weights (fp16 scales for an fp16 checkpoint); a
        calibrated one quantizes the fp32 copy it calibrated, so its scales are bfloat16."""
        import torch

        if self.scale_dtype != "auto":
            return getattr(torch, self.scale_dtype)
        return weight_dtype if weight_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    def group_size_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def check_layer(self, name: str, in_features: int) -> None:
        """A user error if this layer's input width cannot be split into whole groups."""
        if self.group_size != -1 and in_features % self.group_size:
            divisors = [g for g in (32, 64, 128, 256) if in_features % g == 0]
            raise OptkitError(
                f"--group-size {self.group_size} does not divide the {in_features} input features "
                f"of {name}: use -1 (per channel) or one of {divisors or 'the divisors of ' + str(in_features)}"
            )

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        if self.type == "float":
            return f"fp8 e4m3 {group}"
        if self.type == "nf4":
            return f"nf4 {group}{' double-quant' if self.double_quant else ''}"
        return f"w{self.bits} {group} {'sym' if self.symmetric else 'asym'}"


# the fixed weight schemes of the W8A8 methods: int8 (smoothquant, w8a8) and FP8 E4M3 (fp8), per
# output channel
W8_PER_CHANNEL = WeightScheme(bits=8, group_size=-1, symmetric=True)
FP8_PER_CHANNEL = WeightScheme(bits=8, group_size=-1, symmetric=True, type="float")
