"""`optkit eval`'s verdicts: report only without a threshold, pass/fail/inconclusive with the
intervals behind them, exit codes 0/1/4, and the plan."""

import json

import pytest


def strict(text: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def measured(draft_w2, draft_dir, tmp_path_factory):
    """The point estimates of draft_w2 on 12 windows (a report-only run)."""
    from optkit.gate.evaluate import evaluate
    from optkit.gate.options import GateOptions

    return evaluate(draft_w2, draft_dir, GateOptions(max_windows=12)).metrics


def test_without_a_threshold_eval_reports_only_and_never_says_pass(run_cli, draft_w2, draft_dir, tmp_path):
    report = tmp_path / "gate.json"
    code, out, err = run_cli("eval", draft_w2, "--baseline", draft_dir, "--max-windows", "4", "--report", report)
    assert code == 0, err
    assert "REPORT ONLY" in out and "PASS" not in out
    result = strict(report.read_text())
    assert result["verdict"] == "report_only" and result["checks"] == []
    assert result["intervals"]["metrics"]["kld_mean"]["units"] == 4


def test_confident_passes_far_under_the_threshold_and_rejects_far_over(run_cli, draft_w2, draft_dir, measured):
    args = ("eval", draft_w2, "--baseline", draft_dir, "--max-windows", "12", "--decision", "confident", "--json")
    code, out, err = run_cli(*args, "--max-kld", str(10 * measured["kld_mean"]))
    assert code == 0 and strict(out)["verdict"] == "pass", err
    code, out, _ = run_cli(*args, "--max-kld", str(measured["kld_mean"] / 10))
    result = strict(out)
    assert code == 1 and result["verdict"] == "fail" and result["checks"][0]["state"] == "crossed"


def test_confident_at_the_threshold_on_few_windows_is_inconclusive_with_exit_4(run_cli, draft_w2, draft_dir, measured):
    limit = str(1.02 * measured["kld_mean"])  # 2% inside: the point rule passes it, 12 windows cannot prove it
    args = ("eval", draft_w2, "--baseline", draft_dir, "--max-windows", "12", "--max-kld", limit)
    code, out, err = run_cli(*args, "--decision", "confident", "--json")
    result = strict(out)
    assert code == 4, err
    assert result["verdict"] == "inconclusive" and result["checks"][0]["state"] == "unsure"
    assert result["decision"]["extra_windows"] > 0 and result["decision"]["windows_needed"] > 12
    code, out, _ = run_cli(*args, "--decision", "confident")
    assert code == 4 and "INCONCLUSIVE" in out and "more windows would decide it if the estimates hold" in out
    assert run_cli(*args)[0] == 0  # --decision point: today's rule, the default


def test_the_same_seed_writes_the_same_intervals(run_cli, draft_w2, draft_dir):
    args = ("eval", draft_w2, "--baseline", draft_dir, "--max-windows", "6", "--max-kld", "1", "--json")
    first, second = strict(run_cli(*args)[1]), strict(run_cli(*args)[1])
    assert first["intervals"] == second["intervals"] and first["plan"] == second["plan"]
    other = strict(run_cli(*args, "--bootstrap-seed", "1")[1])
    assert other["intervals"] != first["intervals"] and other["metrics"] == first["metrics"]


def test_plan_scores_a_pilot_and_says_what_the_eval_set_resolves(run_cli, draft_w2, draft_dir, measured):
    args = ("eval", draft_w2, "--baseline", draft_dir, "--max-windows", "40", "--plan", "--pilot-windows", "8")
    code, out, err = run_cli(*args, "--max-kld", str(measured["kld_mean"] / 1000), "--json")
    result = strict(out)
    assert code == 0 and result["verdict"] == "report_only", err
    assert result["eval_set"]["windows"] == 8 and result["eval_set"]["pilot_of"] == 40
    kld = result["plan"]["metrics"]["kld_mean"]
    assert kld["eval_units"] == 40 and kld["pilot_units"] == 8 and kld["units_for_threshold"] > 40
    assert "too small for max_kld" in err  # a threshold under the eval set's noise is warned about
    code, out, _ = run_cli(*args, "--max-kld", "1")
    assert code == 0 and "plan: 95% confidence, 80% power" in out and "PASS" not in out
    assert "PLAN (a pilot of 8 of 40 windows, no verdict)" in out
    assert run_cli("eval", draft_w2, "--baseline", draft_dir, "--plan")[0] == 2  # nothing to plan for
