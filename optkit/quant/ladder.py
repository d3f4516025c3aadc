"""The per-layer ladder that repair climbs: weight schemes ordered by the bytes they take.

A rung is a bit width and a group size (`w2g128`, `w3ch` = per output channel, `w4g32`, `w8g128`) or
full precision (`16`). A bare `8` means 8 bits at the artifact's own group size. Each linear of a
mixed artifact sits on one rung; a finer group is a move up just as more bits are. Symmetry and the
number type stay the artifact's.

The default ladder starts at 2 bits: `start: smallest` quantizes every linear on 2-bit g128 and
raises from there, so a model whose uniform 3-bit artifact already passes still gets a mixed
artifact smaller than it. Both formats with per-layer schemes store every rung (compressed-tensors
packs 1-8 bits, GPTQ 2, 3, 4 and 8); which bit widths vLLM reads depends on its version
(docs/compatibility.md, docs/gate.md).

A GGUF file's linears climb ggml's types instead (`GGUF_LADDER`: Q2_K < Q3_K < Q4_K < Q5_K < Q6_K <
Q8_0 < full precision): a rung named by its type, whose bytes are the type's blocks; llama.cpp reads a
file whose linears have any mix of them.
"""

import re
from dataclasses import dataclass

from optkit.weights import gguf_blocks, kquants
from optkit.weights.schemes import SUPPORTED_BITS, WeightScheme
from optkit.weights.stored import StoredScheme, k_scheme

FULL_PRECISION = 16
SAME_GROUP = 0  # group_size of a bare `8`: the artifact's group size, resolved by `Rung.resolve`
# fewest bytes first (at every width the reference models have: 256, 384, 768 input features)
DEFAULT_LADDER = ("w2g128", "w2g64", "w2g32", "w3ch", "w3g128", "w3g64", "w4ch", "w4g128", "w4g64", "w4g32", 8, 16)
_LABEL = re.compile(r"w(\d+)(?:g(\d+)|(ch))")
# ggml types a GGUF linear can be raised to: (values per block, bytes per block), fewest bytes first
GGUF_BLOCKS = {qtype: (kquants.QK_K, kquants.block_bytes(qtype)) for qtype in kquants.K_TYPES}
GGUF_BLOCKS |= {"Q8_0": (gguf_blocks.BLOCK, gguf_blocks.BLOCK_BYTES["Q8_0"])}
GGUF_LADDER = (*GGUF_BLOCKS, FULL_PRECISION)
_Q8_0 = StoredScheme(bits=8, group_size=32, symmetric=True)  # formats/gguf.constrain's scheme for Q8_0


@dataclass(frozen=True)
class Rung:
    bits: int  # FULL_PRECISION: the base's weight as stored
    group_size: int = SAME_GROUP  # -1: per output channel
    gguf_type: str | None = None  # a GGUF rung: ggml's type (GGUF_BLOCKS), whose blocks fix bits and groups

    @classmethod
    def gguf(cls, qtype: str) -> "Rung":
        """The rung of ggml type `qtype` (F16, BF16 and F32: full precision)."""
        if qtype in ("F16", "BF16", "F32"):
            return cls(FULL_PRECISION)
        scheme = _Q8_0 if qtype == "Q8_0" else k_scheme(qtype)
        return cls(scheme.bits, scheme.group_size, qtype)

    @property
    def full(self) -> bool:
        return self.bits >= FULL_PRECISION

    @property
    def label(self) -> str:
        if self.gguf_type is not None:
            return self.gguf_type
        if self.full:
            return str(FULL_PRECISION)
        if self.group_size == SAME_GROUP:
            return str(self.bits)
        return f"w{self.bits}{'ch' if self.group_size == -1 else f'g{self.group_size}'}"

    def describe(self) -> str:
        if self.gguf_type is not None:
            return self.gguf_type
        if self.full:
            return "full precision"
        if self.group_size == SAME_GROUP:
            return f"{self.bits}-bit"
        return f"{self.bits}-bit {'per channel' if self.group_size == -1 else f'g{self.group_size}'}"

    def resolve(self, artifact: WeightScheme) -> "Rung":
        """A bare bit width at the artifact's group size."""
        bare = self.group_size == SAME_GROUP and not self.full and self.gguf_type is None
        return Rung(self.bits, artifact.group_size) if bare else self

    def scheme(self, artifact: WeightScheme) -> WeightScheme:
        assert not self.full, "full precision has no quantization scheme"
        if self.gguf_type is not None:  # the methods round onto the type's grid (formats/gguf.constrain)
            return _Q8_0 if self.gguf_type == "Q8_0" else k_scheme(self.gguf_type)
        rung = self.resolve(artifact)
        return artifact.model_copy(update={"bits": rung.bits, "group_size": rung.group_size})

    def fits(self, in_features: int) -> bool:
        if self.gguf_type is not None:
            return in_features % GGUF_BLOCKS[self.gguf_type][0] == 0
        return self.full or self.group_size in (-1, SAME_GROUP) or in_features % self.group_size == 0

    def to_json(self) -> dict:
        if self.gguf_type is not None:
            return {"gguf_type": self.gguf_type}
        return {"bits": FULL_PRECISION} if self.full else {"bits": self.bits, "group_size": self.group_size}

    @classmethod
    def of(cls, scheme: WeightScheme) -> "Rung":
        return cls(scheme.bits, scheme.group_size)


def parse_rung(value: int | str | dict) -> Rung:
    """`8`, `16`, `"w4g32"`, `"w3ch"`, `"w2g64"`, a GGUF type (`"Q4_K"`, `"Q8_0"`), or a manifest's
    `{"bits": 4, "group_size": 32}` or `{"gguf_type": "Q4_K"}`; ValueError naming what is accepted."""
    if isinstance(value, dict) and set(value) == {"gguf_type"}:
        value = value["gguf_type"]
    if isinstance(value, str) and value in GGUF_BLOCKS:
        return Rung.gguf(value)
    rung = None
    if isinstance(value, dict) and isinstance(value.get("bits"), int):
        full = value["bits"] >= FULL_PRECISION
        rung = Rung(FULL_PRECISION) if full else Rung(value["bits"], value.get("group_size", SAME_GROUP))
    elif isinstance(value, int) and not isinstance(value, bool) and value in (8, FULL_PRECISION):
        rung = Rung(value)
    elif isinstance(value, str) and (match := _LABEL.fullmatch(value)) and int(match[2] or -1) != 0:
        rung = Rung(int(match[1]), -1 if match[3] else int(match[2]))
    if rung is None or not (rung.full or rung.bits in SUPPORTED_BITS) or rung.group_size < -1:
        raise ValueError(
            f"{value!r} is not a precision: use 8 or 16 (full precision), or a scheme such as 'w4g32', "
            f"'w4ch' (per channel), 'w2g64', with bits one of {SUPPORTED_BITS}; for a GGUF file one of "
            f"{', '.join(GGUF_BLOCKS)}"
        )
    return rung


def layer_bytes(shape: list[int], rung: Rung, artifact: WeightScheme, full_itemsize: int = 2) -> int:
    """Bytes a linear [out, in] takes on `rung`: packed weights, one 2-byte scale per group and
    output, and packed zero points when the artifact is asymmetric."""
    out_features, in_features = shape
    if rung.full:
        return out_features * in_features * full_itemsize
    if rung.gguf_type is not None:
        values, size = GGUF_BLOCKS[rung.gguf_type]
        return out_features * (in_features // values) * size
    scheme = rung.scheme(artifact)
    groups = 1 if scheme.group_size == -1 else in_features // scheme.group_size
    zero_points = 0 if scheme.symmetric else out_features * groups * scheme.bits // 8
    return out_features * in_features * scheme.bits // 8 + out_features * groups * 2 + zero_points


def nominal_bits(rung: Rung, artifact: WeightScheme, in_features: int = 4096) -> float:
    """Bits per weight on `rung` for a linear `in_features` wide (the order of the ladder)."""
    return 8 * layer_bytes([1, in_features], rung, artifact) / in_features


def smallest(rungs: list[Rung], artifact: WeightScheme) -> Rung:
    """The quantized rung with the fewest bits per weight: where `start: smallest` begins."""
    return min((r for r in rungs if not r.full), key=lambda r: nominal_bits(r, artifact))
