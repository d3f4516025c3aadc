"""Repair's per-layer ladder (quant/ladder.py): rungs parsed from recipe values, ordered by bytes."""

import pytest

from optkit.quant.ladder import DEFAULT_LADDER, Rung, layer_bytes, nominal_bits, parse_rung, smallest
from optkit.weights.schemes import WeightScheme

ARTIFACT = WeightScheme(bits=4, group_size=128)


@pytest.mark.parametrize("in_features", [256, 384, 768, 4096])
def test_the_default_ladder_climbs_in_bytes_at_every_width(in_features):
    """Each rung takes more bytes than the one before it, on the reference models' widths and a
    large model's, so `start: smallest` starts at the first and each move up is a move."""
    rungs = [parse_rung(x) for x in DEFAULT_LADDER]
    sizes = [layer_bytes([512, in_features], r, ARTIFACT) for r in rungs]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert all(r.fits(in_features) for r in rungs)
    assert smallest(rungs, ARTIFACT) == Rung(2, 128)


def test_2_bit_rungs_are_priced_and_labelled_like_the_others():
    rung = parse_rung("w2g64")
    assert (rung.bits, rung.group_size, rung.label, rung.describe()) == (2, 64, "w2g64", "2-bit g64")
    assert parse_rung({"bits": 2, "group_size": 64}) == rung and parse_rung("w3ch") == Rung(3, -1)
    # 256 inputs per output row: 2 bits each plus 4 scales of 2 bytes
    assert layer_bytes([1, 256], rung, ARTIFACT) == 256 * 2 // 8 + 4 * 2
    assert nominal_bits(rung, ARTIFACT) == pytest.approx(2.25)
    assert rung.scheme(ARTIFACT).bits == 2 and rung.scheme(ARTIFACT).group_size == 64


@pytest.mark.parametrize("value", ["w5g64", "w1g32", "w2g0", 4, "x2g64"])
def test_a_value_that_is_no_rung_names_what_is_accepted(value):
    with pytest.raises(ValueError, match="is not a precision: use 8 or 16"):
        parse_rung(value)


def test_the_gguf_ladder_climbs_ggmls_types_in_their_block_bytes():
    """A GGUF rung is a ggml type: its bytes are the type's blocks (Q4_K: 144 bytes per 256 values),
    its scheme the type's grid, and a manifest's {"gguf_type": ...} reads back as the same rung."""
    from optkit.quant.ladder import GGUF_LADDER
    from optkit.weights.stored import k_type

    rungs = [parse_rung(x) for x in GGUF_LADDER]
    sizes = [layer_bytes([512, 768], r, ARTIFACT) for r in rungs]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert [r.label for r in rungs] == ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "16"]
    q4_k = parse_rung("Q4_K")
    assert layer_bytes([1, 512], q4_k, ARTIFACT) == 2 * 144 and q4_k.describe() == "Q4_K"
    assert k_type(q4_k.scheme(ARTIFACT)) == "Q4_K" and parse_rung(q4_k.to_json()) == q4_k == Rung.gguf("Q4_K")
    assert Rung.gguf("BF16").full and smallest(rungs, ARTIFACT) == Rung.gguf("Q2_K")
    assert not q4_k.fits(384) and parse_rung("Q8_0").fits(384)  # 256-value super-blocks, 32-value blocks
