"""The CPU fast paths (PyTorch's int4 kernel for packed-integer layers, column-major `torch._int_mm` for W8A8, the
scratch dequantization) equal their references within their number formats' tolerance, and the layers
say which path they take. PackedIntLinear runs the int4 kernel here as OPTKIT_CPU_INT4=aten selects it; the
default W4A8 kernel is tests/kernels/test_cpu_w4a8.py's."""

import pytest
import torch
import torch.nn.functional as F

from optkit.kernels import cpu_int4, packed_int
from optkit.kernels.packed_int import PackedIntLinear
from optkit.kernels.w8a8 import W8A8Linear, int8_linear_reference
from tests.kernels.test_packed_int import random_quantized

pytestmark = pytest.mark.skipif(not cpu_int4.aten_kernel_exists(), reason="this torch has no CPU int4 kernel")


@pytest.fixture(autouse=True)
def aten_int4_kernel(monkeypatch):
    monkeypatch.setattr(packed_int, "_aten_chosen", lambda: True)


# bf16 activations (8-bit mantissa) and bf16 scales: ~3e-3 relative error on a random layer's output
BF16_RELATIVE = 1e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def layer_and_reference(bits, group_size, symmetric, act_order, in_features=512, out_features=48, seed=0):
    qw = random_quantized(bits, group_size, symmetric, act_order, out_features, in_features, seed)
    bias = torch.randn(out_features)
    layer = PackedIntLinear.from_quantized(qw, bias)
    return layer, qw.dequantize(torch.float32), bias


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, 512, -1])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_kernel_equals_the_reference_within_bf16(bits, group_size, symmetric, act_order):
    layer, weight, bias = layer_and_reference(bits, group_size, symmetric, act_order)
    assert layer.kernel_for("cpu").startswith(cpu_int4.NAME)
    for rows in (1, 16):
        x = torch.randn(rows, 512)
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 48)
        assert relative_error(got, F.linear(x, weight, bias)) < BF16_RELATIVE
    x = torch.randn(2, 3, 512, dtype=torch.bfloat16)  # bf16 activations, batched shape
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 48)
    assert relative_error(got, F.linear(x.float(), weight, bias)) < BF16_RELATIVE


def test_act_order_permutation_is_not_a_no_op():
    """A kernel that ignored the permutation would be far off: the check above can fail."""
    layer, weight, bias = layer_and_reference(4, 32, False, act_order=True)
    packed = layer.cpu_packed()
    assert packed.perm is not None
    x = torch.randn(4, 512)
    unpermuted = cpu_int4.int4_linear(x, cpu_int4.Int4Packed(**{**packed.__dict__, "perm": None}), bias)
    assert relative_error(unpermuted, F.linear(x, weight, bias)) > 0.3


def test_static_groups_stored_with_g_idx_need_no_permutation():
    qw = random_quantized(4, 64, True, out_features=32, in_features=256)
    qw.g_idx = (torch.arange(256) // 64).to(torch.int32)
    packed = PackedIntLinear.from_quantized(qw).cpu_packed()
    assert not isinstance(packed, str) and packed.perm is None


@pytest.mark.parametrize(
    ("bits", "group_size", "out_features", "reason"),
    [(8, 32, 48, "8-bit"), (4, 16, 48, "group size 16"), (4, 32, 40, "not a multiple of 16")],
)
def test_what_the_kernel_cannot_take_runs_the_exact_reference(bits, group_size, out_features, reason):
    layer, weight, bias = layer_and_reference(bits, group_size, True, False, out_features=out_features)
    assert reason in layer.kernel_for("cpu") and layer.kernel_for("cpu").startswith("dequantize+matmul")
    x = torch.randn(3, 512)
    assert torch.equal(layer(x), F.linear(x, weight, bias))


def test_unequal_act_order_groups_run_the_reference():
    qw = random_quantized(4, 32, True, out_features=16, in_features=128)
    qw.g_idx = torch.tensor([0] * 40 + [1] * 24 + [2] * 32 + [3] * 32, dtype=torch.int32)[torch.randperm(128)]
    layer = PackedIntLinear.from_quantized(qw)
    assert "unequal" in layer.kernel_for("cpu")
    x = torch.randn(2, 128)
    assert torch.equal(layer(x), F.linear(x, qw.dequantize(), None))


def test_long_prefills_take_the_reference_and_stay_within_bf16_of_decode():
    """Prefill over MAX_KERNEL_ROWS rows runs dequantize+matmul, decode the kernel: the same rows
    through both differ by no more than bf16's tolerance."""
    layer, weight, bias = layer_and_reference(4, 128, False, False)
    rows = cpu_int4.MAX_KERNEL_ROWS + 1
    assert layer.kernel_for("cpu", rows).startswith("dequantize+matmul")
    x = torch.randn(rows, 512)
    prefill = layer(x)
    assert torch.equal(prefill, F.linear(x, weight, bias))
    decode = torch.cat([layer(x[i : i + 1]) for i in range(0, rows, 37)])
    assert relative_error(decode, prefill[::37]) < BF16_RELATIVE


def test_repacks_when_the_weights_change():
    layer, _, _ = layer_and_reference(4, 64, True, False)
    first = layer.cpu_packed()
    assert layer.cpu_packed() is first  # packed once
    with torch.no_grad():
        layer.scale.mul_(2)
    assert layer.cpu_packed() is not first


def test_w8a8_on_cpu_is_column_major_and_exact():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (64, 96), generator=gen, dtype=torch.int8)
    layer = W8A8Linear(weight, torch.rand(64, generator=gen) / 100, torch.randn(64, generator=gen))
    x = torch.randn(5, 96, generator=gen)
    before = layer(x)
    assert layer.weight_t.stride() == (1, 96) and torch.equal(layer.weight_t, weight.t())
    assert torch.equal(before, int8_linear_reference(x, layer.weight_t, layer.weight_scale, layer.bias))
    assert torch.equal(layer.state_dict()["weight_t"], weight.t())


def test_threads_flag_sets_torch_threads():
    from optkit.devices import set_cpu_threads

    before = torch.get_num_threads()
    try:
        set_cpu_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_scratch_dequantization_is_the_reference_bit_for_bit(bits, group_size, symmetric):
    """Long prefills dequantize into the thread's scratch buffer: the same weight and output as
    dequantize(), to the bit, with no copy allocated per call."""
    layer, weight, bias = layer_and_reference(bits, group_size, symmetric, False)
    x = torch.randn(cpu_int4.MAX_KERNEL_ROWS + 5, 512)
    with torch.inference_mode():
        fast = layer._dequantize_fast()
        assert fast is not None and torch.equal(fast, weight)
        assert torch.equal(layer(x), F.linear(x, weight, bias))
        again = layer._dequantize_fast()
    assert again.data_ptr() == fast.data_ptr()  # the scratch buffer is reused


def test_scratch_dequantization_leaves_other_layouts_to_the_reference():
    for bits, act_order in ((2, False), (8, False), (4, True)):
        layer, weight, bias = layer_and_reference(bits, 64, True, act_order)
        with torch.inference_mode():
            assert layer._dequantize_fast() is None
            x = torch.randn(cpu_int4.MAX_KERNEL_ROWS + 1, 512)
            assert torch.equal(layer(x), F.linear(x, weight, bias))
    layer, _, _ = layer_and_reference(4, 64, True, False)
    assert layer._dequantize_fast() is None  # autograd on: the buffer would be overwritten under it


def test_concatenated_packed_int_layers_compute_their_parts_side_by_side():
    parts = [layer_and_reference(4, 64, False, False, out_features=n, seed=i)[0] for i, n in enumerate((48, 16, 16))]
    fused = PackedIntLinear.concatenate(parts)
    assert fused.out_features == 80 and fused.kernel_for("cpu").startswith(cpu_int4.NAME)
    with torch.inference_mode():
        for rows in (1, 16, cpu_int4.MAX_KERNEL_ROWS + 3):  # the kernel, then the scratch reference
            x = torch.randn(rows, 512)
            want = torch.cat([p(x) for p in parts], dim=-1)
            assert torch.equal(fused(x), want)
    other = layer_and_reference(3, 64, False, False, out_features=16)[0]
    assert PackedIntLinear.concatenate([parts[0], other]) is None  # 4-bit with 3-bit: kept apart
    grouped = layer_and_reference(4, 128, False, False, out_features=16)[0]
    assert PackedIntLinear.concatenate([parts[0], grouped]) is None


def test_concatenated_w8a8_layers_quantize_the_input_once_and_equal_their_parts():
    gen = torch.Generator().manual_seed(0)

    def layer(out_features, input_scale=None):
        weight = torch.randint(-127, 128, (out_features, 96), generator=gen, dtype=torch.int8)
        return W8A8Linear(weight, torch.rand(out_features, generator=gen) / 100, None, input_scale)

    parts = [layer(64), layer(32)]
    fused = W8A8Linear.concatenate(parts)
    x = torch.randn(5, 96, generator=gen)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert W8A8Linear.concatenate([parts[0], layer(32, torch.tensor(0.1))]) is None  # dynamic with static


def test_a_kept_dequantized_weight_serves_long_inputs_until_the_weights_change():
    """An evaluation holds Ŵ for its run (models/paged_lm.py): the reference's output, to the bit."""
    layer, weight, bias = layer_and_reference(4, 64, False, False)
    layer.keep_dequantized()
    x = torch.randn(cpu_int4.MAX_KERNEL_ROWS + 1, 512)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, weight, bias))
    with torch.no_grad():
        layer.scale.mul_(2)
    with torch.inference_mode():  # the kept copy is stale now: the layer dequantizes the new weights
        assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(), bias))
