"""`optkit eval --sequential` (stop once decided, a random order the per-window cache still serves)
and `optkit eval A --compare B` (the paired difference, with its interval and p-value)."""

import json

import pytest

from optkit.gate import evaluate as evaluate_module


@pytest.fixture(scope="module")
def draft_w4(tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("artifacts") / "draft-w4"
    quantize_model(draft_dir, out, QuantizeOptions())
    return out


@pytest.fixture(scope="module")
def w2_kld(draft_w2, draft_dir):
    from optkit.gate.evaluate import evaluate
    from optkit.gate.options import GateOptions

    return evaluate(draft_w2, draft_dir, GateOptions(max_windows=16, seq_len=64)).metrics["kld_mean"]


def _eval(run_cli, *args):
    code, out, err = run_cli("eval", *map(str, args), "--seq-len", "64", "--json")
    return code, (json.loads(out) if out.strip() else None), err


def test_sequential_stops_early_on_either_side_and_says_how_many_windows(run_cli, draft_w2, draft_dir, w2_kld):
    code, far_inside, err = _eval(run_cli, draft_w2, "--baseline", draft_dir, "--max-kld", 3 * w2_kld, "--sequential")
    assert code == 0, err
    used, available = far_inside["sequential"]["windows"], far_inside["sequential"]["windows_available"]
    assert far_inside["verdict"] == "pass" and 10 <= used <= 48 and available > 4 * used
    assert far_inside["eval_set"]["windows"] == used == len(far_inside["window_kld"])
    code, far_outside, err = _eval(run_cli, draft_w2, "--baseline", draft_dir, "--max-kld", w2_kld / 3, "--sequential")
    assert code == 1, err
    assert far_outside["verdict"] == "fail" and far_outside["sequential"]["windows"] <= 16
    assert "sequential: decided after" in far_outside["decision"]["reason"]
    again = _eval(run_cli, draft_w2, "--baseline", draft_dir, "--max-kld", 3 * w2_kld, "--sequential")[1]
    assert again["window_kld"] == far_inside["window_kld"]  # seeded: the same windows, the same stop


def test_sequential_windows_in_a_random_order_come_from_the_reference_cache(
    run_cli, draft_w2, draft_dir, w2_kld, tmp_path, monkeypatch
):
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    code, _, err = _eval(run_cli, draft_w2, "--baseline", draft_dir, "--max-windows", 40, "--reference-cache")
    assert code == 0, err
    loaded = []
    real_load = evaluate_module.load_model
    monkeypatch.setattr(evaluate_module, "load_model", lambda path, *a, **k: loaded.append(path) or real_load(path))
    code, result, err = _eval(
        run_cli, draft_w2, "--baseline", draft_dir, "--max-windows", 40, "--reference-cache", "--sequential",
        "--max-kld", 3 * w2_kld,
    )  # fmt: skip
    assert code == 0, err
    assert [str(p) for p in loaded] == [str(draft_w2)] and not result["eval_set"]["base_model_loaded"]


def test_sequential_needs_a_threshold_and_a_fixed_number_of_windows(run_cli, draft_w2, draft_dir):
    code, _, err = _eval(run_cli, draft_w2, "--baseline", draft_dir, "--sequential")
    assert code == 2 and "--max-kld" in err
    args = ("--baseline", draft_dir, "--sequential", "--max-kld", 1, "--compare", draft_dir)
    code, _, err = _eval(run_cli, draft_w2, *args)
    assert code == 2 and "--compare" in err


def test_compare_says_which_artifact_is_better_with_an_interval_and_a_p_value(run_cli, draft_w2, draft_w4, draft_dir):
    code, result, err = _eval(run_cli, draft_w4, "--compare", draft_w2, "--baseline", draft_dir, "--max-windows", 16)
    assert code == 0, err  # no threshold: A's verdict is report only
    kld = result["compare"]["metrics"]["kld_mean"]
    assert kld["a"] == pytest.approx(result["metrics"]["kld_mean"])
    assert kld["difference"] < kld["high"] < 0 and kld["p_value"] < 0.01 and kld["better"] == "A"
    top1 = result["compare"]["metrics"]["top1_pct"]
    assert top1["low"] > 0 and top1["better"] == "A"
    assert result["compare"]["metrics"]["ppl_increase_pct"]["units"] == 16
