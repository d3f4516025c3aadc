"""Acceptance of the quantizers on the bundled `small` model (slow: minutes on 2 cores)."""

import pytest

from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.quant.methods.gptq.options import GPTQOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

GROUP_SIZE = 128  # the group size docs/results.md uses


def quality(tmp_path, small_dir, name: str, **options) -> dict:
    quantize_model(small_dir, tmp_path / name, QuantizeOptions(**options))
    return evaluate(tmp_path / name, small_dir, GateOptions()).metrics


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 3])
def test_gptq_recovers_at_least_40_percent_of_rtn_loss(tmp_path, small_dir, bits):
    scheme = WeightScheme(bits=bits, group_size=GROUP_SIZE)
    rtn = quality(tmp_path, small_dir, "rtn", weights=scheme)
    gptq = quality(tmp_path, small_dir, "gptq", method="gptq", weights=scheme)
    assert rtn["ppl_base"] <= 40  # the reference model is trained well enough for damage to show
    assert 0 < gptq["ppl_increase_pct"] <= 0.6 * rtn["ppl_increase_pct"]
    assert gptq["kld_mean"] < rtn["kld_mean"]
    if bits == 3:
        act_order = quality(
            tmp_path,
            small_dir,
            "act-order",
            method="gptq",
            format="gptq",
            weights=scheme,
            gptq=GPTQOptions(act_order=True),
        )
        assert act_order["ppl_increase_pct"] <= gptq["ppl_increase_pct"]
        assert act_order["kld_mean"] <= gptq["kld_mean"]


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 3])
def test_awq_protects_salient_channels(tmp_path, small_outliers_dir, bits):
    """Acceptance, where AWQ's mechanism applies: with activation outliers (as in large models) AWQ
    keeps at most 60% of RTN's perplexity increase and has a lower KLD."""
    scheme = WeightScheme(bits=bits, group_size=GROUP_SIZE, symmetric=False)  # AWQ's usual asymmetric scheme
    rtn = quality(tmp_path, small_outliers_dir, "rtn", weights=scheme)
    awq = quality(tmp_path, small_outliers_dir, "awq", method="awq", weights=scheme)
    assert 0 < awq["ppl_increase_pct"] <= 0.6 * rtn["ppl_increase_pct"]
    assert awq["kld_mean"] < rtn["kld_mean"]


@pytest.mark.slow
def test_awq_beats_rtn_on_small(tmp_path, small_dir):
    """On `small` (no outlier channels) AWQ's gain is mostly its clipping search: a KLD at least 15%
    below RTN's (0.74-0.77x over five calibration seeds in docs/results.md) and a lower perplexity
    increase. The 0.6x perplexity criterion is met on the mean of those seeds (0.56x), not on each."""
    scheme = WeightScheme(bits=4, group_size=GROUP_SIZE, symmetric=False)
    rtn = quality(tmp_path, small_dir, "rtn", weights=scheme)
    awq = quality(tmp_path, small_dir, "awq", method="awq", weights=scheme)
    assert 0 < awq["ppl_increase_pct"] < rtn["ppl_increase_pct"]
    assert awq["kld_mean"] <= 0.85 * rtn["kld_mean"]
