import pytest
from pydantic import ValidationError

from optkit.errors import OptkitError
from optkit.weights.schemes import WeightScheme


@pytest.mark.parametrize("bits", [1, 5, 16])
def test_unsupported_bits_are_rejected(bits):
    with pytest.raises(ValidationError):
        WeightScheme(bits=bits)


def test_unknown_keys_are_rejected():
    with pytest.raises(ValidationError, match="extra"):
        WeightScheme(bits=4, groupsize=128)


def test_group_size_must_divide_the_layer():
    WeightScheme(group_size=64).check_layer("x", 256)
    with pytest.raises(OptkitError, match="does not divide the 200 input features of x"):
        WeightScheme(group_size=128).check_layer("x", 200)


def test_signed_ranges():
    assert (WeightScheme(bits=4).qmin, WeightScheme(bits=4).qmax) == (-8, 7)
    assert (WeightScheme(bits=2).qmin, WeightScheme(bits=2).qmax) == (-2, 1)
