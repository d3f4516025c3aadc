"""What a quantization scheme is: bits, group size, symmetry. Field names are the recipe keys."""

from pydantic import BaseModel, ConfigDict, field_validator

from optkit.errors import OptkitError

SUPPORTED_BITS = (2, 3, 4, 8)


class WeightScheme(BaseModel):
    """Integer weight quantization, one scale (and zero point) per `group_size` input columns.

    group_size -1 means one group per output channel. Integers are signed, as compressed-tensors
    stores them: q in [-2^(bits-1), 2^(bits-1) - 1], w ≈ (q - zero_point) * scale.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True

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

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

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
        return f"w{self.bits} {group} {'sym' if self.symmetric else 'asym'}"
