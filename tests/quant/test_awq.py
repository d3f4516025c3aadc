import pytest
import torch

from optkit.errors import OptkitError
from optkit.families.llama import LLAMA
from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.modeldir import read_tensors
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.formats import awq as awq_format
from optkit.quant.formats.load import load_model
from optkit.quant.layer_step import fold_scale
from optkit.quant.methods.awq import math as awq
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

FAST_CALIB = CalibrationOptions(num_samples=8, seq_len=64)


def test_folding_scales_leaves_the_full_precision_model_unchanged(draft_dir):
    """Acceptance: W ← W·diag(s) with 1/s folded into the norm or linear before it."""
    model = load_model(draft_dir)
    tokens = torch.randint(0, model.config.vocab_size, (2, 48))
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        expected = model(tokens).logits
        for layer in model.model.layers:
            for previous, linears, _ in LLAMA.smoothing_groups:
                width = layer.get_submodule(linears[0]).in_features
                prev = layer.get_submodule(previous)
                if (prev.out_features if isinstance(prev, torch.nn.Linear) else prev.weight.numel()) != width:
                    continue  # v -> o with grouped-query attention: shapes do not fold
                fold_scale(layer, previous, linears, torch.rand(width, generator=generator) * 4 + 0.25)
        folded = model(tokens).logits
    torch.testing.assert_close(folded, expected, atol=1e-4, rtol=1e-4)


def test_candidate_scales_cover_the_grid():
    x_mag, w_mag = torch.rand(16) + 0.1, torch.rand(16) + 0.1
    candidates = list(awq.candidate_scales(x_mag, w_mag, grid=20))
    assert len(candidates) == 40 and {c[1] for c in candidates} == {False, True}
    alpha, duo, s = candidates[0]
    assert alpha == 0 and not duo and torch.allclose(s, torch.ones(16))
    for _, _, s in candidates:
        assert torch.isclose(s.max() * s.min(), torch.tensor(1.0), rtol=1e-4)


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_never_increases_the_output_error(symmetric):
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    w[0, 3] = 12.0  # an outlier weight that stretches its group's range
    x = torch.randn(256, 64)
    scheme = WeightScheme(bits=3, group_size=32, symmetric=symmetric)
    bounds = awq.search_clip(w, x, scheme, scale_dtype=torch.float32)
    lower, upper = bounds
    groups = w.reshape(32, 2, 32)
    range_lower, range_upper = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    if symmetric:  # the range a symmetric scheme quantizes is ±max|w|
        range_upper = torch.maximum(-range_lower, range_upper)
        range_lower = -range_upper
        assert torch.equal(lower, -upper)
    assert bounds.shape == (2, 32, 2)
    assert (range_lower <= lower).all() and (lower <= 0).all() and (0 <= upper).all() and (upper <= range_upper).all()

    def error(weight):
        return ((x @ (w - awq.fake_quantize(weight, scheme, torch.float32)).T) ** 2).mean()

    assert error(awq.clip(w, bounds)) < error(w)


def _group_output_error(w, x, scheme, lower, upper):
    """mean((x (Q(clamp(w, lower, upper)) − w)ᵀ)²) for one row-group w ([1, gs]) and its inputs x."""
    w_hat = awq.fake_quantize(w.clamp(lower, upper), scheme, torch.float32)
    return ((x @ (w_hat - w).T) ** 2).mean().item()


def test_asymmetric_clip_search_picks_the_best_pair_of_bounds():
    """Each (row, group) gets the (lower, upper) shrink pair with the smallest output error of that
    group, checked against a direct search over the pairs."""
    torch.manual_seed(1)
    w = torch.randn(4, 16)
    w[0, 2], w[1, 9] = -6.0, 5.0  # one long negative tail, one long positive tail
    x = torch.randn(64, 16)
    scheme = WeightScheme(bits=3, group_size=8, symmetric=False)
    steps, max_shrink = 4, 0.5
    bounds = awq.search_clip(w, x, scheme, steps=steps, max_shrink=max_shrink, scale_dtype=torch.float32)
    lo0, hi0 = w.reshape(4, 2, 8).amin(-1).clamp(max=0), w.reshape(4, 2, 8).amax(-1).clamp(min=0)
    factors = [1 - max_shrink * i / steps for i in range(steps + 1)]
    for row in range(4):
        for group in range(2):
            w_group, x_group = w[row : row + 1, group * 8 : group * 8 + 8], x[:, group * 8 : group * 8 + 8]
            best = min(
                _group_output_error(w_group, x_group, scheme, lo0[row, group] * a, hi0[row, group] * b)
                for a in factors
                for b in factors
            )
            lower, upper = bounds[:, row, group].tolist()
            assert _group_output_error(w_group, x_group, scheme, lower, upper) == pytest.approx(best, rel=1e-4)
    both_ends = (lo0 < 0) & (hi0 > 0)  # groups whose range has two ends to shrink
    lower_factor, upper_factor = (bounds[0] / lo0)[both_ends], (bounds[1] / hi0)[both_ends]
    assert not torch.allclose(lower_factor, upper_factor)  # the ends were shrunk independently
    shared = awq.search_clip(w, x, scheme, steps=steps, independent_ends=False, scale_dtype=torch.float32)
    assert torch.equal(shared[0], -shared[1])  # AutoAWQ's clipping: ±max|w| shrunk as one bound


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_layout_round_trip_is_exact(symmetric):
    qw = rtn_quantize(torch.randn(48, 64), WeightScheme(bits=4, group_size=32, symmetric=symmetric))
    tensors = awq_format.compress("p", qw)
    assert tensors["p.qweight"].shape == (64, 6) and tensors["p.qzeros"].shape == (2, 6)
    back = awq_format.decompress("p", tensors, qw.scheme)
    assert torch.equal(back.q, qw.q) and torch.equal(back.zero_point, qw.zero_point)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_awq_nibble_order_matches_autoawq():
    values = torch.arange(8).view(1, 8)  # column c holds the value c
    packed = awq_format._pack_columns(values).item()
    nibbles = [(packed >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]


def test_awq_layout_refuses_what_it_cannot_store():
    with pytest.raises(OptkitError, match="4-bit"):
        awq_format.check(WeightScheme(bits=3), False, [])
    with pytest.raises(OptkitError, match="act-order"):
        awq_format.check(WeightScheme(bits=4), "group", [])
    with pytest.raises(OptkitError, match="group size"):
        awq_format.check(WeightScheme(bits=4, group_size=-1), False, [])


def test_awq_artifacts_fold_scales_and_read_back_in_both_formats(tmp_path, draft_dir):
    common = dict(method="awq", weights=WeightScheme(bits=4, group_size=64, symmetric=False), calibration=FAST_CALIB)
    quantize_model(draft_dir, tmp_path / "ct", QuantizeOptions(**common))
    quantize_model(draft_dir, tmp_path / "awq", QuantizeOptions(**common, format="awq"))
    base, artifact = read_tensors(draft_dir), read_tensors(tmp_path / "ct")
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(base[norm], artifact[norm])  # the scales were folded into the norm
    assert "model.layers.0.mlp.up_proj.qweight" in read_tensors(tmp_path / "awq")
    metrics = [evaluate(tmp_path / n, draft_dir, GateOptions(max_windows=8)).metrics for n in ("ct", "awq")]
    assert metrics[0] == metrics[1]
    assert metrics[0]["kld_mean"] < 0.05
