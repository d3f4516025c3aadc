import pytest
import torch

from optkit.errors import OptkitError
from optkit.quant.methods.gptq.math import (
    GPTQOptions,
    accumulate_hessian,
    all_finite,
    empty_hessian,
    gptq_quantize,
    inverse_hessian_factor,
    output_error,
)
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.weights.schemes import WeightScheme


def correlated_inputs(tokens: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated, unequally scaled channels, like real activations: [tokens, in]."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(features, features, generator=g) / features**0.5
    scales = torch.logspace(-1, 1, features)[torch.randperm(features, generator=g)]
    return (
        torch.randn(tokens, features, generator=g) @ mixing + 0.3 * torch.randn(tokens, features, generator=g)
    ) * scales


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    h, n = empty_hessian(x.shape[1])
    for chunk in x.split(37):
        h, n = accumulate_hessian(h, n, chunk)
    return h


def test_running_hessian_equals_the_batch_formula():
    x = torch.randn(200, 12)
    torch.testing.assert_close(hessian_of(x), 2 * x.T @ x / 200, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,group_size", [(4, 16), (3, 16), (2, -1), (4, -1), (8, 32)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_never_worse_than_rtn(bits, group_size, act_order):
    x = correlated_inputs(512, 64)
    w = torch.randn(24, 64)
    h = hessian_of(x)
    scheme = WeightScheme(bits=bits, group_size=group_size)
    result = gptq_quantize(w, h, scheme, GPTQOptions(act_order=act_order), scale_dtype=torch.float32)
    rtn_error = output_error(w, rtn_quantize(w, scheme, torch.float32).dequantize(), h)
    assert result.loss <= rtn_error
    direct = ((x @ (w - result.weight.dequantize()).T) ** 2).sum(1).mean().item()
    assert result.loss == pytest.approx(direct, rel=1e-3)


def test_with_identity_hessian_gptq_is_rtn():
    w = torch.randn(16, 64)
    scheme = WeightScheme(bits=4, group_size=16, symmetric=False)
    result = gptq_quantize(w, torch.eye(64), scheme, scale_dtype=torch.float32)
    expected = rtn_quantize(w, scheme, torch.float32)
    assert torch.equal(result.weight.q, expected.q)
    assert torch.equal(result.weight.scale, expected.scale)
    assert result.weight.g_idx is None


def test_act_order_g_idx_dequantizes_to_the_weights_the_loss_was_computed_with():
    x = correlated_inputs(256, 32)
    h = hessian_of(x)
    w = torch.randn(8, 32)
    result = gptq_quantize(
        w, h, WeightScheme(bits=3, group_size=8), GPTQOptions(act_order=True), scale_dtype=torch.float32
    )
    qw = result.weight
    assert qw.g_idx is not None and qw.g_idx.shape == (32,)
    assert torch.bincount(qw.g_idx.long()).tolist() == [8, 8, 8, 8]  # every group has group_size columns
    # the columns quantized first (largest H_ii) form group 0
    first = torch.argsort(torch.diag(h), descending=True)[:8]
    assert set(qw.g_idx[first].tolist()) == {0}
    assert result.loss == pytest.approx(output_error(w, qw.dequantize(), h), rel=1e-6)


def test_static_groups_keep_g_idx_contiguous():
    h = hessian_of(correlated_inputs(256, 32))
    w = torch.randn(8, 32)
    result = gptq_quantize(
        w,
        h,
        WeightScheme(bits=4, group_size=8),
        GPTQOptions(act_order=True, static_groups=True),
        scale_dtype=torch.float32,
    )
    assert result.weight.g_idx is None
    # group parameters are those of RTN on the original weight
    assert torch.equal(result.weight.scale, rtn_quantize(w, WeightScheme(bits=4, group_size=8), torch.float32).scale)


def test_dead_inputs_are_handled():
    x = correlated_inputs(256, 16)
    x[:, 3] = 0
    result = gptq_quantize(torch.randn(4, 16), hessian_of(x), WeightScheme(bits=4, group_size=-1))
    assert torch.isfinite(result.weight.scale.float()).all() and result.loss >= 0


def test_singular_hessian_raises_dampening_with_a_warning():
    x = torch.randn(64, 1) @ torch.randn(1, 16)  # rank one
    h = hessian_of(x)
    with pytest.warns(UserWarning, match="dampening"):
        result = gptq_quantize(torch.randn(4, 16), h, WeightScheme(bits=4, group_size=-1), GPTQOptions(damp=0.0))
    assert result.damp > 0


def test_non_finite_inputs_name_the_layer():
    h = torch.eye(8)
    with pytest.raises(OptkitError, match="mlp.up_proj: the weight contains NaN"):
        gptq_quantize(torch.full((2, 8), float("nan")), h, WeightScheme(group_size=-1), name="mlp.up_proj")
    h[0, 0] = float("inf")
    with pytest.raises(OptkitError, match="activations contain NaN or inf"):
        gptq_quantize(torch.randn(2, 8), h, WeightScheme(group_size=-1), name="mlp.up_proj")


@pytest.mark.parametrize("act_order", [False, True])
def test_inverse_hessian_factor_is_the_upper_cholesky_factor_of_the_damped_inverse(act_order):
    x = correlated_inputs(256, 24)
    x[:, 5] = 0  # a dead input
    h = hessian_of(x)
    dead = torch.diag(h) == 0
    perm = torch.randperm(24) if act_order else torch.arange(24)
    before = h.clone()
    U, damp = inverse_hessian_factor(h, perm, dead, 0.01, GPTQOptions(), "layer")
    assert torch.equal(h, before)  # only read: callers still need it for the losses
    H = h.clone()
    H[dead, dead] = 1
    H = H[perm][:, perm].double()
    H.diagonal().add_(damp * H.diagonal().mean())
    torch.testing.assert_close(U.double().T @ U.double(), torch.linalg.inv(H), rtol=1e-4, atol=1e-6)
    assert torch.equal(U, U.triu())


def test_gptq_leaves_the_hessian_it_is_given_unchanged():
    h = hessian_of(correlated_inputs(256, 32))
    before = h.clone()
    gptq_quantize(torch.randn(8, 32), h, WeightScheme(bits=4, group_size=16), GPTQOptions(act_order=True))
    assert torch.equal(h, before)


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_all_finite_agrees_with_isfinite(value, layout):
    x = torch.randn(9, 7)
    if value is not None:
        x[4, 2] = value
    if layout == "column-major":
        x = x.T.contiguous().T
    assert all_finite(x) == bool(torch.isfinite(x).all())
