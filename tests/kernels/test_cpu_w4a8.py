"""The CPU W4A8 kernel (kernels/cpu_w4a8.py) equals the dequantize reference within the rounding of
its int8 activations, on every group size, zero-point kind and act-order, at any row count, on both
instruction sets; the layers fall back to PyTorch's int4 kernel where it cannot build."""

import pytest
import torch
import torch.nn.functional as F

from optkit.kernels import cpu_int4, cpu_w4a8, packed_int
from optkit.kernels.packed_int import PackedIntLinear
from tests.kernels.broken_build import failed_build_reason
from tests.kernels.test_packed_int import random_quantized

pytestmark = pytest.mark.skipif(bool(cpu_w4a8.unavailable_reason()), reason="the W4A8 kernel does not build here")
EPS32 = torch.finfo(torch.float32).eps


def isas() -> list[str]:
    """The instruction sets this CPU runs: AVX2 always (the kernel needs it), AVX-512 VNNI where present."""
    return ["avx2", "native"] if torch.ops.optkit_w4a8.cpu_isa() == 2 else ["avx2"]


@pytest.fixture(params=isas())
def isa(request, monkeypatch):
    monkeypatch.setenv("OPTKIT_CPU_ISA", "avx2" if request.param == "avx2" else "")
    cpu_w4a8.selected_isa.cache_clear()
    yield request.param
    cpu_w4a8.selected_isa.cache_clear()


def error_bound(x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """[M, N]: the most the output can move. Each activation is rounded to the nearest multiple of its
    block's step d = max|x| / 127 over 32 consecutive (packed-order) columns, so |x - d·a| <= d / 2 and
    |Δy[m, n]| <= Σ_b d[m, b] / 2 · Σ_{k ∈ b} |Ŵ[n, k]|; plus float32 summation over K terms
    (K · eps · Σ_k |Ŵ[n, k] x[m, k]|)."""
    if perm is not None:
        x, weight = x[:, perm], weight[:, perm]
    rows, (out_features, in_features) = x.shape[0], weight.shape
    step = x.abs().view(rows, -1, 32).amax(-1).double() / 127  # [M, B]
    w_abs = weight.abs().double()
    rounding = 0.5 * step @ w_abs.view(out_features, -1, 32).sum(-1).t()
    return rounding + in_features * EPS32 * (x.abs().double() @ w_abs.t())


def layer_and_reference(bits, group_size, symmetric, act_order, in_features=512, out_features=48, seed=0):
    qw = random_quantized(bits, group_size, symmetric, act_order, out_features, in_features, seed)
    bias = torch.randn(out_features)
    return PackedIntLinear.from_quantized(qw, bias), qw.dequantize(torch.float32), bias


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, 512, -1])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a8_kernel_equals_the_reference_within_int8_activation_rounding(isa, bits, group_size, symmetric, act_order):
    layer, weight, bias = layer_and_reference(bits, group_size, symmetric, act_order)
    assert layer.kernel_for("cpu") == cpu_w4a8.name()
    assert ("AVX2" in cpu_w4a8.name()) == (isa == "avx2")
    packed = layer.cpu_packed()
    for rows in (1, 3, 16, 100):
        x = torch.randn(rows, 512)
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 48)
        error = (got.double() - F.linear(x.double(), weight.double(), bias.double())).abs()
        assert (error <= error_bound(x, weight, packed.perm)).all()
        assert error.max() > 0  # the activations are rounded: an exact result would mean another path ran


def q8_0_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's q8_0 activations in the float32 steps the kernel takes: per 32 columns d = max|x| / 127 and
    a = round-half-even(x · (127 / max|x|)) (0 where max|x| = 0); xs = the group's Σ d · Σ a, block by block."""
    rows, cols = x.shape
    amax = x.abs().view(rows, -1, 32).amax(-1)  # [M, B]
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    a = (x.view(rows, -1, 32) * inv.unsqueeze(-1)).round()  # float32 products, to nearest even
    d = amax / 127
    terms = d * a.sum(-1)  # each d · Σ a rounded to float32
    per_group = group_size // 32
    xs = torch.zeros(rows, cols // group_size)
    for b in range(cols // 32):
        xs[:, b // per_group] += terms[:, b]
    return a.view(rows, cols).to(torch.int8), d, xs


@pytest.mark.parametrize("group_size", [32, 128])
def test_the_activations_are_q8_0s_to_the_bit(isa, group_size):
    """Each instruction set's quantization of the activations gives ggml's q8_0 numbers exactly: ties,
    zero blocks, signed zeros, subnormals and huge values included."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(group_size)) * 4
    x[0, :32] = 0.0
    x[1, 32:64] = -0.0
    x[2] = 1e30 * x[2].sign()
    x[3, 5] = 1e-40
    x[4] = torch.arange(256) % 32 - 15.5  # with max|x| = 127 below the step is 1: every value a tie at .5
    x[4, ::32] = 127.0
    got = torch.ops.optkit_w4a8.quantize(x, group_size, cpu_w4a8.selected_isa())
    for name, mine, want in zip(("a", "d", "xs"), got, q8_0_reference(x, group_size), strict=True):
        assert torch.equal(mine, want), name


def test_bf16_inputs_and_batched_shapes_come_back_in_their_dtype_and_shape(isa):
    layer, weight, bias = layer_and_reference(4, 64, False, False)
    x = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 48)
    # the kernel runs in float32; the layer's bias is cast to the activations' dtype first
    want = cpu_w4a8.w4a8_linear(x.float().view(6, 512), layer.cpu_packed(), bias.to(torch.bfloat16))
    assert torch.equal(got, want.view(2, 3, 48).to(torch.bfloat16))


@pytest.mark.parametrize("out_features", [8, 40, 1000])
def test_outputs_past_the_last_full_tile_of_16(isa, out_features):
    layer, weight, bias = layer_and_reference(4, 32, True, False, out_features=out_features, in_features=96)
    x = torch.randn(5, 96)
    error = (layer(x).double() - F.linear(x.double(), weight.double(), bias.double())).abs()
    assert (error <= error_bound(x, weight, None)).all()


@pytest.mark.parametrize("symmetric", [True, False])
def test_compact_and_float32_parameters_give_the_same_bits(isa, symmetric):
    """bf16 scales travel as 3 bytes (bf16 s, int8 8 + z) where every scale is a bf16 value, else as
    8 (float32 s and s · (8 + z)): s · (8 + z) is exact in float32, so the outputs are equal."""
    qw = random_quantized(4, 64, symmetric, False, 40, 256)  # bf16 scales
    compact = cpu_w4a8.pack(qw.q, qw.scale, qw.zero_point, 4)
    wide = cpu_w4a8.pack(qw.q, qw.scale, qw.zero_point, 4, compact=False)
    assert compact.params.dtype == torch.uint8 and wide.params.dtype == torch.float32
    assert compact.params.numel() * 8 == wide.params.numel() * 4 * 3  # 3 bytes an output and group, not 8
    x = torch.randn(5, 256)
    assert torch.equal(cpu_w4a8.w4a8_linear(x, compact), cpu_w4a8.w4a8_linear(x, wide))
    finer = cpu_w4a8.pack(qw.q, qw.scale.float() * (1 + 2**-12), qw.zero_point, 4)  # not bf16 values
    assert finer.params.dtype == torch.float32
    fractional = cpu_w4a8.pack(qw.q, qw.scale, qw.zero_point.float() + 0.25, 4)  # no int8 8 + z
    assert fractional.params.dtype == torch.float32


def test_a_wrong_permutation_exceeds_the_bound():
    """The bound is tight enough to catch a kernel that ignored act-order: the check above can fail."""
    layer, weight, bias = layer_and_reference(4, 32, False, act_order=True)
    packed = layer.cpu_packed()
    assert packed.perm is not None
    x = torch.randn(4, 512)
    unpermuted = cpu_w4a8.w4a8_linear(x, cpu_w4a8.W4A8Packed(**{**packed.__dict__, "perm": None}), bias)
    error = (unpermuted.double() - F.linear(x.double(), weight.double(), bias.double())).abs()
    assert not (error <= error_bound(x, weight, packed.perm)).all()


def test_a_row_gets_the_same_output_alone_as_in_a_batch(isa):
    """Decode (one row) and prefill (many) take the same kernel, and each row's arithmetic does not
    depend on the others: equal to the bit for the same input row (prefill and decode attention give
    rows ~1e-6 apart, which int8 rounding can move by a step: tests/gate/test_gate_serves_alike.py)."""
    layer, _, _ = layer_and_reference(4, 128, False, True)
    x = torch.randn(37, 512)
    batch = layer(x)
    for i in (0, 5, 36):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])
    assert layer.kernel_for("cpu", rows=4096) == cpu_w4a8.name()


def test_calls_of_any_shape_in_turn_each_get_their_own_result(isa):
    """A call's quantized activations live in a buffer kept from call to call (at decode's few rows):
    a call after a larger or smaller one, of other rows and columns, gets what it gets alone."""
    layers = {k: layer_and_reference(4, 64, False, False, in_features=k, seed=k)[0] for k in (2048, 512)}
    calls = [(2048, 16), (512, 1), (2048, 3), (512, 17), (512, 16), (2048, 1)]
    inputs = {(k, m): torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)) for k, m in calls}
    alone = {}
    for k, m in calls:  # each first in a process where a larger call has not run yet (per shape)
        alone[k, m] = layers[k](inputs[k, m])
    for k, m in reversed(calls):
        assert torch.equal(layers[k](inputs[k, m]), alone[k, m])


def test_the_out_variant_writes_the_same_bits_into_its_tensor_and_refuses_a_wrong_one(isa):
    """`linear_out` (the fused decode stack's: an output it keeps from layer to layer) writes what
    `linear` returns, into the tensor given; one of the wrong shape or dtype is a ValueError."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (48, 512), generator=gen, dtype=torch.int8)
    scale = (torch.rand(48, 8, generator=gen) * 0.01 + 1e-3).bfloat16().float()
    packed = cpu_w4a8.pack(q, scale, torch.zeros(48, 8), 4)
    x = torch.randn(3, 512, generator=gen)
    args = (packed.weight, packed.params, None, packed.out_features, packed.group_size, cpu_w4a8.selected_isa())
    out = torch.full((3, packed.out_features), float("nan"))
    torch.ops.optkit_w4a8.linear_out(x, *args, out)
    assert torch.equal(out, torch.ops.optkit_w4a8.linear(x, *args))
    for wrong in (torch.empty(2, packed.out_features), torch.empty(3, packed.out_features, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out float32"):
            torch.ops.optkit_w4a8.linear_out(x, *args, wrong)


def test_thread_count_is_honoured_and_does_not_change_the_result():
    """at::parallel_for splits the output tiles over torch's threads (`--threads N` sets them); each
    output is computed by one thread in a fixed order, so any thread count gives the same bits."""
    layer, _, _ = layer_and_reference(4, 64, True, False, out_features=256)
    x = torch.randn(7, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(before)


def test_what_the_kernel_cannot_take_goes_to_the_next_path():
    eight_bit, weight, bias = layer_and_reference(8, 32, True, False)
    assert eight_bit.kernel_for("cpu").startswith("dequantize+matmul")
    x = torch.randn(3, 512)
    assert torch.equal(eight_bit(x), F.linear(x, weight, bias))
    assert "group size 16" in cpu_w4a8.pack(*_parts(4, 16))


def _parts(bits, group_size):
    qw = random_quantized(bits, group_size, True, False, 16, 64)
    return qw.q, qw.scale, qw.zero_point, bits, qw.g_idx


def test_a_failed_build_says_why_and_falls_back_to_the_aten_int4_kernel(monkeypatch, tmp_path):
    if not cpu_int4.aten_kernel_exists():
        pytest.skip("this torch has no CPU int4 kernel to fall back to")
    failed_build_reason(monkeypatch, tmp_path, cpu_w4a8, cpu_w4a8._build.__wrapped__)  # not the cached result
    layer, weight, bias = layer_and_reference(4, 64, True, False)
    kernel = layer.kernel_for("cpu")
    assert kernel.startswith(cpu_int4.NAME) and "C++ build failed" in kernel
    x = torch.randn(3, 512)
    assert torch.equal(layer(x), cpu_int4.int4_linear(x, layer.cpu_packed(), bias))


def test_aten_and_the_reference_stay_selectable(monkeypatch):
    layer, weight, bias = layer_and_reference(4, 64, True, False)
    monkeypatch.setattr(packed_int, "_aten_chosen", lambda: True)
    if cpu_int4.aten_kernel_exists():
        assert layer.kernel_for("cpu") == f"{cpu_int4.NAME} (w4a8: OPTKIT_CPU_INT4=aten)"
    with cpu_int4.reference_only():
        x = torch.randn(3, 512)
        assert layer.kernel_for("cpu").startswith("dequantize+matmul")
        assert torch.equal(layer(x), F.linear(x, weight, bias))


def test_no_dequantized_copy_is_kept_where_the_kernel_takes_every_row():
    layer, _, _ = layer_and_reference(4, 64, True, False)
    layer.keep_dequantized()
    assert "_kept" not in layer.__dict__
    with cpu_int4.reference_only():
        layer.keep_dequantized()
    assert "_kept" in layer.__dict__
