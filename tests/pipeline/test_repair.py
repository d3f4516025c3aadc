"""Repair (pipeline/repair.py): the gate raises the precision of the layers that cause the most KLD
until it passes, and writes an artifact every reader loads."""

import json

import pytest

from optkit.gate.options import GateOptions, RepairOptions
from optkit.manifest import read_manifest
from optkit.pipeline.repair import repair, size_mb

WINDOWS = 4  # gate windows of 256 tokens: enough to separate 4-bit draft from its repairs


@pytest.fixture(scope="module")
def uniform_w4(tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("repair") / "w4"
    quantize_model(draft_dir, out, QuantizeOptions())
    return out


def gate(max_kld: float, **repair_options) -> GateOptions:
    return GateOptions(max_kld=max_kld, max_windows=WINDOWS, repair=RepairOptions(windows=4, **repair_options))


def test_repair_passes_a_target_that_uniform_4_bit_fails(uniform_w4, draft_dir, tmp_path, monkeypatch):
    from optkit.compat.transformers_load import check_transformers_load
    from optkit.gate.evaluate import evaluate

    options = gate(0.006)
    uniform = evaluate(uniform_w4, draft_dir, options)
    assert not uniform.passed  # uniform 4-bit draft: KLD ~0.011
    outcome = repair(uniform_w4, draft_dir, options, tmp_path, initial=uniform)
    assert outcome.passed and outcome.gate.metrics["kld_mean"] <= 0.006
    assert 0 < len(outcome.raised) and sum(r.bits >= 8 for r in outcome.raised.values()) < 14
    assert all(r.bits in (4, 8, 16) and r.label != "w4g128" for r in outcome.raised.values())
    assert size_mb(outcome.artifact) < 1.5 * size_mb(uniform_w4)
    manifest = read_manifest(outcome.artifact)
    steps = manifest["repair"]["steps"]
    assert steps[0]["passed"] is False and steps[manifest["repair"]["chosen_step"]]["passed"] is True
    for step in steps[1:]:
        assert step["changed"] and step["kld_mean"] > 0 and step["size_mb"] > 0
    assert manifest["precision_overrides"] == {name: rung.to_json() for name, rung in outcome.raised.items()}
    assert manifest["repair"]["attribution"]["layers"][0]["estimate"] > 0
    # a mixed-scheme artifact as every reader loads it: transformers (compressed-tensors) = runtime
    # (its reference path: the question is the per-layer schemes, not the CPU int4 kernel's rounding)
    monkeypatch.setenv("OPTKIT_CPU_INT4", "0")
    config = json.loads((outcome.artifact / "config.json").read_text())["quantization_config"]
    assert len(config["config_groups"]) > 1 or len(config["ignore"]) > 1
    check = check_transformers_load(outcome.artifact)
    assert check.ok, check.problems
    # and the gate, re-run from the files, agrees with what repair measured
    again = evaluate(outcome.artifact, draft_dir, options)
    assert again.metrics["kld_mean"] == pytest.approx(outcome.gate.metrics["kld_mean"], rel=1e-4)


def test_moves_climb_the_ladder_by_estimated_drop_per_byte(uniform_w4, draft_dir):
    """A finer group is a move of its own: priced from the attribution's per-rung estimates, taken
    before 8 bits when it pays more per byte; nothing moves to a rung with fewer bytes."""
    from optkit.gate.attribution import Attribution, LayerSensitivity
    from optkit.pipeline.repair import weight_itemsizes
    from optkit.pipeline.repair_plan import plan_moves
    from optkit.quant.ladder import parse_rung

    manifest = read_manifest(uniform_w4)
    down = "model.layers.0.mlp.down_proj"
    layers = []
    for layer in manifest["layers"]:
        big = 10.0 if layer["name"] == down else 1.0  # down_proj: most of the KLD
        moves = {"w4g64": 0.5 * big, "w4g32": 0.8 * big, "w8g128": 0.99 * big}
        layers.append(LayerSensitivity(layer["name"], big, big, moves["w8g128"], moves))
    rungs = [parse_rung(x) for x in RepairOptions().precisions]
    moves = plan_moves(Attribution(1.0, "test", 1, 1.0, layers), manifest, weight_itemsizes(draft_dir), rungs)
    assert moves[0].unit == [down] and moves[0].rung.label == "w4g64"  # 0.5 nats for 1/32 more bytes
    mine = [m for m in moves if m.unit == [down]]
    assert [m.rung.label for m in mine] == ["w4g64", "w4g32", "w8g128", "16"]
    assert all(a.gain > 0 and a.extra_bytes > 0 for a in mine)
    assert sum(m.gain for m in mine) == pytest.approx(10.0)  # the whole way to full precision
    lower = {"w2g128", "w2g64", "w2g32", "w3ch", "w3g128", "w3g64", "w4ch", "w4g128"}  # fewer bytes or none more
    assert len(rungs) == 12 and not {m.rung.label for m in moves} & lower
    ratios = [m.gain / m.extra_bytes for m in moves]
    assert ratios[0] == max(ratios)


def test_max_evaluations_is_honoured(uniform_w4, draft_dir, tmp_path, monkeypatch):
    import optkit.pipeline.repair as module

    calls = []
    real = module.evaluate
    monkeypatch.setattr(module, "evaluate", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    outcome = repair(uniform_w4, draft_dir, gate(1e-9, precisions=[8], max_evaluations=1), tmp_path)
    assert not outcome.passed and "max_evaluations" in outcome.reason
    assert len(calls) == 2  # the uniform artifact's gate and one repaired candidate
    assert len(read_manifest(outcome.artifact)["repair"]["steps"]) == 2


def test_awq_artifacts_are_refused_in_one_line(draft_dir, tmp_path):
    from optkit.errors import OptkitError
    from optkit.quant.formats.mixed import check_mixed

    with pytest.raises(OptkitError, match="--format awq has no per-layer precision"):
        check_mixed("awq")


def test_each_failing_candidate_is_attributed_again_and_climbed_from(draft_dir, tmp_path, monkeypatch):
    """`reattribute`: after a failing candidate the next moves are planned from its own attribution,
    so each step keeps every layer the one before raised, on a rung of at least as many bytes."""
    import optkit.pipeline.repair as module
    import optkit.pipeline.repair_plan as plan
    from optkit.quant.ladder import layer_bytes, parse_rung
    from optkit.quant.mixed_artifact import artifact_scheme
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    start = tmp_path / "w2"
    quantize_model(draft_dir, start, QuantizeOptions(weights=WeightScheme(bits=2, group_size=128)))
    attributed = []
    real = module.attribute
    monkeypatch.setattr(module, "attribute", lambda path, *a, **k: attributed.append(path) or real(path, *a, **k))
    monkeypatch.setattr(plan, "MARGIN", 3.0)  # aim 3x over the target: every candidate fails
    outcome = repair(start, draft_dir, gate(0.006, max_evaluations=3), tmp_path / "work")
    assert not outcome.passed and "max_evaluations" in outcome.reason
    record = read_manifest(outcome.artifact)["repair"]
    steps = record["steps"]
    assert [s["passed"] for s in steps] == [False] * 4 and record["reattributed_after"] == [1, 2]
    assert attributed == [start, tmp_path / "work" / "step-1", tmp_path / "work" / "step-2"]
    manifest = read_manifest(start)
    scheme, shapes = artifact_scheme(manifest), {x["name"]: x["shape"] for x in manifest["layers"]}
    for before, after in zip(steps[1:-1], steps[2:], strict=True):
        assert after["kld_mean"] < before["kld_mean"] and after["size_mb"] > before["size_mb"]
        for name, rung in before["raised"].items():
            assert name in after["raised"]
            grown = layer_bytes(shapes[name], parse_rung(after["raised"][name]), scheme)
            assert grown >= layer_bytes(shapes[name], parse_rung(rung), scheme)


def test_a_target_out_of_the_estimates_reach_is_approached_in_waypoints():
    """When even every move of the plan is not predicted to reach the target, the plan aims at a
    quarter of its start's KLD (to be attributed again there) instead of taking every move."""
    from optkit.pipeline.repair_plan import MARGIN, WAYPOINT, Move, aim_kld, extend_prefix
    from optkit.quant.ladder import Rung

    moves = [Move([f"layer{i}"], Rung(16), gain, 100) for i, gain in enumerate([0.5, 0.3, 0.1, 0.05])]
    assert aim_kld(0.5, 1.0, 1.0, moves, reattribute=True) == MARGIN * 0.5  # reachable: the target itself
    assert aim_kld(0.01, 1.0, 1.0, moves, reattribute=False) == MARGIN * 0.01
    aim = aim_kld(0.01, 1.0, 1.0, moves, reattribute=True)  # 1.0 - 0.95 = 0.05 > 0.009: out of reach
    assert aim == WAYPOINT * 1.0
    chosen, _ = extend_prefix([], moves, 1.0, 1.0, aim, float("inf"))
    assert chosen == moves[:2]  # 1.0 - 0.8 = 0.2 <= 0.25, not all four


def test_the_shrink_step_interpolates_the_gate_between_the_measured_prefixes():
    """Regula falsi: the gate's KLD is read linearly in the cumulative estimated drop between the
    failing prefix and the passing one; the shortest prefix strictly between them under the aim."""
    from optkit.pipeline.repair_plan import Move, secant_prefix
    from optkit.quant.ladder import Rung

    moves = [Move([f"layer{i}"], Rung(16), gain, 100) for i, gain in enumerate([0.4, 0.3, 0.2, 0.1])]
    # failed with 0 moves at KLD 1.0, passed with 4 at 0.0: KLD(k) = 1 - cumulative[k]
    assert secant_prefix(moves, 0, 1.0, 4, 0.0, 0.35) == 2  # 1 - 0.7 = 0.3 <= 0.35; 1 - 0.4 > 0.35
    assert secant_prefix(moves, 0, 1.0, 4, 0.0, 0.0) == 3  # none under the aim: one short of passing
    flat = [Move([f"layer{i}"], Rung(16), 0.0, 100) for i in range(6)]
    assert secant_prefix(flat, 0, 1.0, 6, 0.0, 0.5) == 3  # no estimated drop to interpolate in: bisect
