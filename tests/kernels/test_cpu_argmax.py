"""cpu_decode.argmax: greedy decoding's argmax in C++ gives torch.argmax's index on every row."""

import pytest
import torch

from optkit.kernels import cpu_decode

pytestmark = pytest.mark.skipif(bool(cpu_decode.unavailable_reason()), reason=cpu_decode.unavailable_reason() or "runs")


def rows(vocab: int) -> torch.Tensor:
    """Rows whose answer is hard to get right: ties, NaNs before and after the max, infinities,
    signed zeros, a max in the tail past the last 16 columns."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=gen)
    x[1, 3] = x[1, vocab - 1] = 50.0  # a tie: the first index
    x[2, vocab // 2] = float("nan")  # a NaN counts as the largest
    x[3, 0], x[3, vocab - 1] = 100.0, float("nan")  # a NaN after the max
    x[4] = float("-inf")  # every value -inf: index 0
    x[5, :] = 0.0
    x[5, vocab // 3] = -0.0  # -0.0 equals +0.0: index 0
    x[6, vocab - 1] = 1e9  # in the tail past the vector loop
    x[7] = x[7].abs().neg() - 1.0
    x[7, vocab - 2] = -0.5  # every value negative
    x[8, 5] = float("inf")
    x[8, 9] = float("inf")
    x[9, :] = 3.0  # all equal
    x[10, 2], x[10, 1] = float("nan"), float("nan")
    return x


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 31, 33, 100, 49152, 49157])  # AVX2 reads 32 a step
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_index_is_torch_argmaxs_on_every_row(vocab, isa, monkeypatch):
    if isa == "avx2":  # AVX2's loops where the CPU has it (else the portable ones), as without AVX-512
        monkeypatch.setattr(cpu_decode, "avx512", lambda: False)
    x = rows(vocab) if vocab > 12 else torch.randn(3, vocab)
    got = cpu_decode.argmax(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1))


def test_other_dtypes_and_shapes_take_atens_argmax():
    x = torch.randn(2, 3, 40).bfloat16()
    assert torch.equal(cpu_decode.argmax(x), x.argmax(dim=-1))
    y = torch.randn(40)
    assert torch.equal(cpu_decode.argmax(y), y.argmax(dim=-1))
