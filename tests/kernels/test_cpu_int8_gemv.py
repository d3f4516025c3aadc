"""optkit's int8 GEMV for W8A8 layers at decode (kernels/cpu_int8_gemv.py): the int32 result of
torch._int_mm exactly, and the whole dynamic linear in one call with the PyTorch code's bits, so a
W8A8 artifact's outputs do not depend on which ran, on each instruction set the CPU has."""

import pytest
import torch

from optkit.kernels import cpu_int8_gemv
from optkit.kernels.w8a8 import W8A8Linear, quantize_activations

pytestmark = pytest.mark.skipif(
    bool(cpu_int8_gemv.unavailable_reason()), reason=f"int8 GEMV: {cpu_int8_gemv.unavailable_reason()}"
)


def isas() -> list[str]:
    """The instruction sets this CPU runs: AVX2 always (the kernel needs it), AVX-512 VNNI where present."""
    if cpu_int8_gemv.unavailable_reason():
        return ["avx2"]  # every test skips
    return ["avx2", "native"] if torch.ops.optkit_int8_gemv.cpu_isa() == 2 else ["avx2"]


@pytest.fixture(params=isas(), autouse=True)
def isa(request, monkeypatch):
    monkeypatch.setenv("OPTKIT_CPU_ISA", "avx2" if request.param == "avx2" else "")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    cpu_int8_gemv.selected_isa.cache_clear()
    assert (cpu_int8_gemv.selected_isa() == 1) == (request.param == "avx2")
    yield request.param
    cpu_int8_gemv.selected_isa.cache_clear()


def column_major(weight: torch.Tensor) -> torch.Tensor:
    return weight.t()  # [K, N] over the storage of [N, K], as W8A8Linear.prepare leaves weight_t


@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (7, 33), (100, 64), (300, 65), (48, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_equals_int_mm_at_every_row_count_and_column_tail(out_features, in_features, rows):
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features + rows)
    weight_t = column_major(torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8))
    qx = torch.randint(-128, 128, (rows, in_features), generator=gen, dtype=torch.int8)
    got = cpu_int8_gemv.int8_gemv(qx, weight_t, cpu_int8_gemv.weight_sums(weight_t))
    assert got.dtype == torch.int32 and torch.equal(got, torch._int_mm(qx, weight_t))


@pytest.mark.parametrize("rows", [9, 17, 64])
def test_avx2_takes_any_row_count_and_vnni_up_to_eight(isa, rows):
    """On AVX2 every row count runs here (in passes of 8 rows), with _int_mm's int32 result; with VNNI
    past 8 rows oneDNN's GEMM is faster, and the kernel stands aside."""
    gen = torch.Generator().manual_seed(rows)
    weight_t = column_major(torch.randint(-128, 128, (70, 96), generator=gen, dtype=torch.int8))
    qx = torch.randint(-128, 128, (rows, 96), generator=gen, dtype=torch.int8)
    assert cpu_int8_gemv.takes(qx, weight_t) == (isa == "avx2")
    if isa == "avx2":
        got = cpu_int8_gemv.int8_gemv(qx, weight_t, cpu_int8_gemv.weight_sums(weight_t))
        assert torch.equal(got, torch._int_mm(qx, weight_t))
        x = torch.randn(rows, 96, generator=gen)
        scale = torch.rand(70, generator=gen) / 50
        got = cpu_int8_gemv.int8_linear_dynamic(x, weight_t, cpu_int8_gemv.weight_sums(weight_t), scale, None)
        assert torch.equal(got, pytorch_linear(x, weight_t, scale, None))


@pytest.mark.parametrize(("weight", "activation"), [(-128, 127), (-128, -128), (127, -128)])
def test_the_widest_row_it_takes_does_not_overflow(weight, activation):
    """The shifted products sum to -255 * 128 * K at the extremes (VNNI), the int16 ones to 2^14 * K
    (AVX2): still an int32 at K = 65,792."""
    in_features = cpu_int8_gemv.max_columns()
    weight_t = column_major(torch.full((16, in_features), weight, dtype=torch.int8))
    qx = torch.full((1, in_features), activation, dtype=torch.int8)
    assert cpu_int8_gemv.takes(qx, weight_t)
    got = cpu_int8_gemv.int8_gemv(qx, weight_t, cpu_int8_gemv.weight_sums(weight_t))
    assert torch.equal(got, torch.full((1, 16), weight * activation * in_features, dtype=torch.int32))
    assert not cpu_int8_gemv.takes(torch.zeros(1, in_features + 1, dtype=torch.int8), column_major(
        torch.zeros(16, in_features + 1, dtype=torch.int8)))  # fmt: skip


def test_a_w8a8_layer_gives_the_same_bits_through_either_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (96, 160), generator=gen, dtype=torch.int8)
    layer = W8A8Linear(weight, torch.rand(96, generator=gen) / 100, torch.randn(96, generator=gen))
    x = torch.randn(4, 160, generator=gen)
    assert layer.kernel_for("cpu", rows=4).startswith("optkit C++ int8 GEMV")
    fast = layer(x)
    assert layer.weight_sums is not None
    monkeypatch.setattr(cpu_int8_gemv, "takes", lambda qx, weight_t: False)
    assert torch.equal(fast, layer(x))


def test_weights_written_in_place_are_summed_again():
    gen = torch.Generator().manual_seed(1)
    layer = W8A8Linear(torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8), torch.full((32,), 0.01))
    x = torch.randn(1, 64, generator=gen)
    layer(x)
    with torch.no_grad():
        layer.weight_t.neg_()
    expected = W8A8Linear(layer.weight_t.t().contiguous(), layer.weight_scale)(x)
    assert torch.equal(layer(x), expected)


def test_a_layer_built_in_inference_mode_runs():
    """Inference tensors have no version counter: the layer keys its weight sums without one."""
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        layer = W8A8Linear(torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8), torch.full((32,), 0.01))
        x = torch.randn(2, 64, generator=gen)
        assert torch.equal(layer(x), layer(x.clone()))


def pytorch_linear(x, weight_t, weight_scale, bias):
    """w8a8.int8_linear's PyTorch code: per-row quantization, torch._int_mm, the rescaling."""
    qx, sx = quantize_activations(x)
    y = torch.mul(torch._int_mm(qx, weight_t), sx).mul_(weight_scale)
    return y if bias is None else y.add_(bias)


@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (7, 33), (300, 65), (48, 576)])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("biased", [False, True])
def test_the_dynamic_linear_in_one_call_has_the_pytorch_codes_bits(out_features, in_features, rows, biased):
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features + rows)
    weight_t = column_major(torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8))
    scale, bias = torch.rand(out_features, generator=gen) / 50, torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen) * 10 ** torch.randint(-3, 4, (rows, 1), generator=gen)
    x[0, : in_features // 2] = x[0, 0].abs() * torch.arange(in_features // 2) / 254  # quotients at .5: ties
    if rows > 1:
        x[1] = 0  # the scale's floor: 1e-12
    if rows > 2:
        x[2, 0] = 1e-30
    got = cpu_int8_gemv.int8_linear_dynamic(x, weight_t, cpu_int8_gemv.weight_sums(weight_t), scale,
                                            bias if biased else None)  # fmt: skip
    assert torch.equal(got, pytorch_linear(x, weight_t, scale, bias if biased else None))


def test_the_dynamic_linear_keeps_the_pytorch_codes_nans_and_infinities():
    gen = torch.Generator().manual_seed(3)
    weight_t = column_major(torch.randint(-128, 128, (40, 64), generator=gen, dtype=torch.int8))
    x = torch.randn(4, 64)
    x[0, 5], x[1, 7], x[2, 9], x[2, 10] = float("nan"), float("inf"), float("-inf"), 3.0
    scale = torch.full((40,), 0.01)
    got = cpu_int8_gemv.int8_linear_dynamic(x, weight_t, cpu_int8_gemv.weight_sums(weight_t), scale, None)
    torch.testing.assert_close(got, pytorch_linear(x, weight_t, scale, None), rtol=0, atol=0, equal_nan=True)
