"""Repair on an inconclusive candidate: it is gated on the whole eval set before repair climbs."""

import pytest

import optkit.pipeline.repair as repair_module
from optkit.gate.decision import Decision
from optkit.gate.evaluate import GateResult
from optkit.gate.options import GateOptions, RepairOptions
from optkit.gate.thresholds import Check

AVAILABLE = 187  # windows of heldout at 256 tokens


@pytest.fixture(scope="module")
def uniform_w4(tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("repair") / "w4"
    quantize_model(draft_dir, out, QuantizeOptions())
    return out


def gated(verdict: str, windows: int) -> GateResult:
    state = {"pass": "ok", "fail": "crossed", "inconclusive": "unsure"}[verdict]
    check = Check("max_kld", "kld_mean", 0.0098, 0.01, verdict == "pass", state)
    return GateResult(
        "candidate",
        "base",
        {"name": "heldout", "windows": windows, "windows_available": AVAILABLE},
        {"kld_mean": 0.0098, "ppl_increase_pct": 1.0, "top1_pct": 95.0},
        [check],
        decision=Decision(verdict, "confident", 0.05, [check]),
    )


@pytest.fixture
def gate_calls(monkeypatch):
    """A fake gate: inconclusive on 12 windows; on the whole set, what the test says."""
    calls, on_the_whole_set = [], {"verdict": "pass"}

    def evaluate(artifact, base, options):
        calls.append(options.max_windows)
        if options.max_windows is None:
            return gated(on_the_whole_set["verdict"], AVAILABLE)
        return gated("inconclusive", options.max_windows)

    def attribute(*args, **kwargs):
        raise RuntimeError("repair climbed")

    monkeypatch.setattr(repair_module, "evaluate", evaluate)
    monkeypatch.setattr(repair_module, "attribute", attribute)
    return calls, on_the_whole_set


def options() -> GateOptions:
    return GateOptions(max_kld=0.01, max_windows=12, decision="confident", repair=RepairOptions(windows=2))


def test_an_inconclusive_candidate_is_gated_on_the_whole_eval_set_before_repair_climbs(
    uniform_w4, draft_dir, tmp_path, gate_calls
):
    calls, _ = gate_calls
    outcome = repair_module.repair(uniform_w4, draft_dir, options(), tmp_path)
    assert calls == [12, None]  # the subset, then every window
    assert outcome.passed and outcome.attribution is None  # decided there: nothing raised
    assert outcome.steps[0]["verdict"] == "pass" and outcome.steps[0]["windows"] == AVAILABLE


def test_a_candidate_still_inconclusive_on_the_whole_set_is_repaired(uniform_w4, draft_dir, tmp_path, gate_calls):
    calls, on_the_whole_set = gate_calls
    on_the_whole_set["verdict"] = "inconclusive"
    with pytest.raises(RuntimeError, match="repair climbed"):
        repair_module.repair(uniform_w4, draft_dir, options(), tmp_path)
    assert calls == [12, None]


def test_a_gate_on_every_window_already_is_not_rerun(uniform_w4, draft_dir, tmp_path, gate_calls):
    calls, _ = gate_calls
    whole = options().model_copy(update={"max_windows": None})
    with pytest.raises(RuntimeError, match="repair climbed"):  # the full set was inconclusive: climb
        repair_module.repair(uniform_w4, draft_dir, whole, tmp_path, initial=gated("inconclusive", AVAILABLE))
    assert calls == []
