"""bf16 linears with the weight packed for oneDNN (kernels/cpu_bf16.py) and through optkit's AVX2
kernel (kernels/cpu_bf16_gemv.py) equal the plain bf16 path within bf16's rounding, at decode's row
counts and at a prefill's (oneDNN's past its UPCAST_ROWS: fp32 GEMM on the weight made fp32), and a
bf16 runtime model loaded on the CPU runs the one this CPU has, its logits within bf16 tolerance of
the plain bf16 model's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optkit.kernels import cpu_bf16, cpu_bf16_gemv
from optkit.kernels.cpu_bf16 import PackedBf16Linear
from optkit.kernels.cpu_bf16_gemv import GemvBf16Linear
from optkit.models.loader import load_runtime_model

no_onednn = pytest.mark.skipif(not cpu_bf16.available(), reason="no oneDNN bf16 path on this CPU")
no_gemv = pytest.mark.skipif(
    bool(cpu_bf16_gemv.unavailable_reason()), reason="optkit's AVX2 bf16 kernel does not run here"
)
# each bf16 linear with the kernel it names at a row count
LINEARS = [
    pytest.param(
        (PackedBf16Linear, lambda rows: cpu_bf16.UPCAST_NAME if rows > cpu_bf16.UPCAST_ROWS else cpu_bf16.NAME),
        marks=no_onednn,
        id="onednn",
    ),
    pytest.param((GemvBf16Linear, lambda rows: cpu_bf16_gemv.NAME), marks=no_gemv, id="avx2"),
]


def exact_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The products of bf16 inputs summed in float64, rounded once to bf16."""
    y = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return y.to(torch.bfloat16)


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """got and want differ by at most what fp32 summation order and one bf16 rounding allow: a bf16
    ulp of the output (2^-7 relative) plus a small absolute slack for outputs near zero."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    slack = want.float().abs() * 2**-7 + 1e-2 * want.float().abs().mean()
    assert ((got.float() - want.float()).abs() <= slack).all()


@pytest.mark.parametrize("linear_class", LINEARS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, cpu_bf16.UPCAST_ROWS + 1, 300])
# 100 x 70: not whole oneDNN blocks; 37 x 70 and 7 x 3: rows past the AVX2 kernel's 4 and columns past its 16
@pytest.mark.parametrize("shape", [(256, 128), (100, 70), (37, 70), (7, 3)])
def test_packed_linear_equals_the_exact_bf16_product(linear_class, rows, shape, bias):
    linear_class, kernel_name = linear_class
    torch.manual_seed(rows)
    out_features, in_features = shape
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = linear_class.from_linear(linear)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    want = exact_bf16_linear(x, linear.weight, linear.bias)
    with torch.inference_mode():
        got = packed(x)
        plain = F.linear(x, linear.weight, linear.bias)
    assert_within_one_rounding(got, want)
    assert_within_one_rounding(plain, want)  # the tolerance holds for the path it replaces too
    assert packed.kernel_for("cpu", rows) == kernel_name(rows)


@pytest.mark.parametrize("linear_class", LINEARS)
def test_the_check_can_fail(linear_class):
    """A layer with the wrong weight (one output row off) fails the same check."""
    linear_class, _ = linear_class
    torch.manual_seed(0)
    linear = nn.Linear(64, 128, bias=False).to(torch.bfloat16)
    other = linear.weight.detach().clone()
    other[5] += 0.5
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = linear_class(other)(x)
    with pytest.raises(AssertionError):
        assert_within_one_rounding(got, exact_bf16_linear(x, linear.weight, None))


@pytest.mark.parametrize("linear_class", LINEARS)
def test_packed_weight_unpacks_bit_for_bit_and_batched_inputs_keep_their_shape(linear_class):
    linear_class, _ = linear_class
    torch.manual_seed(0)
    weight = torch.randn(96, 40, dtype=torch.bfloat16)
    layer = linear_class(weight)
    assert torch.equal(layer.weight, weight)
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert layer(x).shape == (2, 3, 96)
        assert torch.equal(layer(x), layer(x.reshape(6, 40)).reshape(2, 3, 96))


def test_the_fast_linear_is_onednns_where_it_has_a_bf16_path_else_the_avx2_kernel():
    if cpu_bf16.available():
        assert cpu_bf16.fast_linear_class() is PackedBf16Linear
    elif not cpu_bf16_gemv.unavailable_reason():
        assert cpu_bf16.fast_linear_class() is GemvBf16Linear
    else:
        assert cpu_bf16.fast_linear_class() is None


fast_linear = pytest.mark.skipif(cpu_bf16.fast_linear_class() is None, reason="no fast bf16 linear on this CPU")


@fast_linear
def test_pack_linears_swaps_only_bf16_cpu_linears():
    model = nn.Sequential(nn.Linear(8, 16).to(torch.bfloat16), nn.Linear(16, 8), nn.Embedding(4, 8))
    assert cpu_bf16.pack_linears(model) == 1
    assert isinstance(model[0], cpu_bf16.fast_linear_class()) and type(model[1]) is nn.Linear


@fast_linear
def test_bf16_runtime_model_packs_its_linears_and_head_and_matches_the_plain_model(small_dir):
    packed = load_runtime_model(small_dir, dtype=torch.bfloat16)
    plain = load_runtime_model(small_dir, dtype=torch.bfloat16, fuse=True, pack=False)
    linear_class = cpu_bf16.fast_linear_class()
    layers = [m for m in packed.modules() if isinstance(m, linear_class)]
    config = packed.config
    assert len(layers) == 4 * config.num_hidden_layers + 1  # qkv, o, gate_up, down; the (tied) head
    assert not any(isinstance(m, linear_class) for m in plain.modules())
    if linear_class is GemvBf16Linear:  # the AVX2 kernel's tied head reads the embedding itself: no copy
        assert packed.lm_head.weight.data_ptr() == packed.get_input_embeddings().weight.data_ptr()
    assert load_runtime_model(small_dir, dtype=torch.float32).lm_head is None  # fp32 stays as it was
    from optkit.kernels.paged_attention import AttentionMetadata
    from optkit.models.llama import allocate_kv_caches

    torch.manual_seed(0)
    n = cpu_bf16.UPCAST_ROWS + 32  # one prefill over UPCAST_ROWS rows, the head over every position
    ids = torch.randint(0, config.vocab_size, (n,))
    logits = []
    for model in (packed, plain):
        blocks = -(-n // 16)
        meta = AttentionMetadata.build([n], [n], [list(range(blocks))], list(range(n)))
        caches = allocate_kv_caches(config, blocks, 16, torch.bfloat16)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, torch.arange(n), meta, caches)))
    got, want = logits
    # bf16 activations through every layer: the two paths may round differently along the way (bf16
    # against fp32 logits differ by ~3e-3 on this model); they agree on the top token nearly everywhere
    assert (got - want).norm() / want.norm() < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@no_gemv
@pytest.mark.parametrize(
    "x, weight",
    [
        (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16)),  # K differs
        (torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16)),  # fp32 x
        (torch.zeros(0, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)),  # no rows
        (torch.zeros(2, 0, dtype=torch.bfloat16), torch.zeros(4, 0, dtype=torch.bfloat16)),  # no columns
    ],
)
def test_the_avx2_kernel_refuses_what_it_cannot_take_with_a_value_error(x, weight):
    with pytest.raises(ValueError, match="bf16 linear"):
        cpu_bf16_gemv._linear_op()(x, weight, None)
