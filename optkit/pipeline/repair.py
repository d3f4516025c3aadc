"""The gate repairs what it rejects: raise the precision of the layers that cause the most KLD per
byte until the gate passes, the size budget is spent or the evaluations are.

1. Attribute the failing artifact (gate/attribution.py, on calibration text neither the calibration
   nor the gate read): each linear's estimated KLD drop on every rung above its own and in full
   precision. With `start: smallest` the caller quantizes that artifact on the smallest rung
   (`start_options`), so repair builds the smallest mixed artifact up from below.
2. Plan (pipeline/repair_plan.py, where the model and its math are written out): group the
   linears as vLLM fuses them (q/k/v, gate/up) and order the moves (unit, rung of the ladder in
   quant/ladder.py: more bits or a finer group, up to full precision) by estimated drop per extra
   byte, each unit's moves in ladder order along the upper concave hull of drop against bytes.
3. Take moves until the predicted KLD on the gate's set is under the target with a 10% margin
   (the prediction: the gate's KLD minus the calibrated drops, rescaled from the attribution set to
   the gate's set), write that artifact (quant/mixed_artifact.py) and gate it. If it fails,
   attribute that candidate again and plan the next moves from it (`reattribute`, the default), or
   refit the rescaling to what the gate measured and take more moves of the first plan. With
   `reattribute`, a plan whose every move together is not predicted to reach the target aims at a
   waypoint instead (a quarter of the KLD it starts from). Once one passes, spend up to
   `shrink_evaluations` on shorter prefixes of the moves, each chosen by interpolating the gate's
   KLD between the last failing and the last passing prefix in the cumulative estimated drop
   (regula falsi), and keep the smallest artifact that passes. Every evaluation is a step in the manifest.
   A candidate the gate calls inconclusive (`decision: confident` on `max_windows` windows) is
   gated again on the whole eval set before repair climbs from it (`settle`).

Why attribute again: the estimate is a first-order step from the attributed weights, good near
them. From the default 2-bit start (KLD 0.16-0.18 on `small`, target 0.01) the first plan must
remove 94% of the KLD on the estimate's word, and a 5% error in it is half the target; the first
failing candidate (0.02-0.03) is a much closer point to linearize at. Measured on `small+outliers` at
0.01: 3.733 MiB without, 3.633 MiB with (docs/results.md, repair). Far below the start (small-moe
from 2 bits, KLD 0.02, at target 0.0001) no plan reaches the target on the estimate, and taking
every move put every layer in full precision (11.2 MiB, more than uniform 8-bit); waypoints got
there at 5.3 MiB.
"""

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from optkit.artifacts import remove_dir, replace_dir
from optkit.errors import OptkitError
from optkit.gate.attribution import Attribution, attribute
from optkit.gate.evaluate import GateResult, evaluate
from optkit.gate.options import GateOptions, RepairOptions
from optkit.manifest import read_manifest, write_manifest
from optkit.modeldir import weight_files
from optkit.pipeline.repair_plan import (
    SHRINK_AIM,
    Move,
    aim_kld,
    extend_prefix,
    gate_rescale,
    plan_moves,
    raised_rungs,
    refit_rescale,
    secant_prefix,
    target_kld,
)
from optkit.quant.formats.mixed import check_mixed
from optkit.quant.ladder import Rung, smallest
from optkit.quant.mixed_artifact import WEIGHTS, write_mixed_artifact
from optkit.safetensors_stream import lazy_tensors_in


@dataclass
class RepairOutcome:
    passed: bool
    artifact: Path  # the artifact that passed, or the closest one
    gate: GateResult
    steps: list[dict] = field(default_factory=list)
    attribution: Attribution | None = None
    reason: str | None = None
    raised: dict[str, Rung] = field(default_factory=dict)


def size_mb(artifact: Path) -> float:
    return (artifact / WEIGHTS).stat().st_size / 2**20


def _step(index: int, raised: dict[str, Rung], result: GateResult, artifact: Path, changed: list[str]) -> dict:
    m = result.metrics
    return {
        "step": index,
        "changed": changed,
        "raised": {name: rung.to_json() for name, rung in sorted(raised.items())},
        "kld_mean": m["kld_mean"],
        "ppl_increase_pct": m["ppl_increase_pct"],
        "top1_pct": m["top1_pct"],
        "size_mb": round(size_mb(artifact), 4),
        "passed": result.passed,
        "verdict": result.verdict,
        "windows": result.eval_set.get("windows"),
    }


def settle(artifact: Path, base: Path, gate: GateOptions, result: GateResult, log) -> GateResult:
    """An inconclusive gate (`decision: confident` on a `max_windows` subset) is not a failure to
    climb from: the candidate is gated again on the whole eval set first, which decides most
    candidates; one still inconclusive there is treated as failing (repair raises more layers)."""
    windows, available = result.eval_set.get("windows"), result.eval_set.get("windows_available")
    if result.verdict != "inconclusive" or gate.max_windows is None or (windows or 0) >= (available or 0):
        return result
    log(f"repair: {artifact.name} is inconclusive on {windows} windows; gating it on all {available}")
    return evaluate(artifact, base, gate.model_copy(update={"max_windows": None}))


def weight_itemsizes(base: Path) -> dict[str, int]:
    """Bytes per element of each tensor of the base checkpoint: what a layer in full precision costs."""
    itemsize = {}
    for file in weight_files(base):
        itemsize.update({k: t.dtype.itemsize for k, t in lazy_tensors_in(file).items()})
    return itemsize


def repair(
    artifact: Path, base: Path, gate: GateOptions, work: Path, *, initial: GateResult | None = None, log=None
) -> RepairOutcome:
    """Gate `artifact`; if it fails, repair it into `work/step-N` directories (module doc). The
    outcome names the artifact that passed or, failing that, the one with the lowest KLD; its
    optkit.json holds the whole record."""
    log = log or (lambda line: None)
    options = gate.repair or RepairOptions()
    manifest = read_manifest(artifact)
    if manifest is None:
        raise OptkitError(f"{artifact} has no optkit.json: repair starts from an optkit artifact")
    check_mixed(manifest["format"])
    result = settle(artifact, base, gate, initial or evaluate(artifact, base, gate), log)
    steps = [_step(0, {}, result, artifact, [])]
    if result.passed:
        return RepairOutcome(True, artifact, result, steps)
    target = target_kld(gate, result)

    def attribute_at(candidate: Path) -> Attribution:
        windows, exact = options.windows, options.exact_swaps
        return attribute(candidate, base, windows=windows, seq_len=gate.seq_len, exact=exact, rungs=options.rungs)

    attribution = attribute_at(artifact)
    first_attribution = attribution  # the record's: what the artifact as given owes to each layer
    itemsize = weight_itemsizes(base)
    moves = plan_moves(attribution, manifest, itemsize, options.rungs)
    budget = math.inf if options.max_size_mb is None else options.max_size_mb * 2**20
    rescale = gate_rescale(result.metrics["kld_mean"], attribution.kld)
    best = (result.metrics["kld_mean"], artifact, result, {}, 0)  # (KLD, directory, gate, rungs, step)
    # the plan's moves start from `source` (the artifact, or the last failing candidate attributed
    # again), whose layers are already raised as in `prior`; its gate KLD is `source_kld`
    source, prior, source_kld = artifact, {}, result.metrics["kld_mean"]
    taken: list[Move] = []
    failed_count, failed_kld = 0, source_kld  # the largest prefix that failed, its KLD
    reason = None
    evaluation = 0
    reattributed: list[int] = []

    def trial(moves: list[Move], previous: list[Move]) -> GateResult:
        nonlocal best, evaluation
        evaluation += 1
        raised = {**prior, **raised_rungs(moves)}
        out = work / f"step-{evaluation}"
        write_mixed_artifact(source, base, raised_rungs(moves), out, {})
        result = settle(out, base, gate, evaluate(out, base, gate), log)
        before = {**prior, **raised_rungs(previous)}
        changed = sorted(n for n in raised.keys() | before.keys() if raised.get(n) != before.get(n))
        steps.append(_step(evaluation, raised, result, out, changed))
        log(
            f"repair step {evaluation}: raised {len(raised)} linears, KLD {result.metrics['kld_mean']:.5f} "
            f"(target {target:g}), {steps[-1]['size_mb']:.2f} MB: {result.verdict}"
        )
        smaller = result.passed and (not best[2].passed or size_mb(out) < size_mb(best[1]))
        if smaller or (not best[2].passed and result.metrics["kld_mean"] < best[0]):
            best = (result.metrics["kld_mean"], out, result, raised, evaluation)
        return result

    while evaluation < options.max_evaluations:
        room = budget - (source / WEIGHTS).stat().st_size
        aim = aim_kld(target, source_kld, rescale, moves, options.reattribute)
        chosen, over_budget = extend_prefix(taken, moves, source_kld, rescale, aim, room)
        if len(chosen) == len(taken):
            reason = f"the size budget ({options.max_size_mb} MB) is spent" if over_budget else "no layer left to raise"
            break
        result = trial(chosen, taken)
        if result.passed:  # shrink: search between the last failing prefix and this one
            passing, passing_kld = len(chosen), result.metrics["kld_mean"]
            for _ in range(options.shrink_evaluations):
                if passing - failed_count <= 1 or evaluation >= options.max_evaluations:
                    break
                k = secant_prefix(chosen, failed_count, failed_kld, passing, passing_kld, SHRINK_AIM * target)
                shorter = trial(chosen[:k], chosen[:passing])
                if shorter.passed:
                    passing, passing_kld = k, shorter.metrics["kld_mean"]
                else:
                    failed_count, failed_kld = k, shorter.metrics["kld_mean"]
            break
        failed_count, failed_kld = len(chosen), result.metrics["kld_mean"]
        taken = chosen
        if result.metrics["kld_mean"] <= target:  # another threshold failed: aim lower
            target = 0.8 * result.metrics["kld_mean"]
        if options.reattribute and evaluation < options.max_evaluations:  # linearize again here
            source, prior, source_kld = work / f"step-{evaluation}", {**prior, **raised_rungs(taken)}, failed_kld
            attribution = attribute_at(source)
            moves = plan_moves(attribution, read_manifest(source), itemsize, options.rungs)
            rescale = gate_rescale(source_kld, attribution.kld)
            taken, failed_count = [], 0
            reattributed.append(evaluation)
            continue
        rescale = refit_rescale(rescale, source_kld, result.metrics["kld_mean"], taken)
    else:
        reason = f"{options.max_evaluations} gate evaluations (max_evaluations) did not reach it"
    _, chosen_dir, chosen_result, raised, chosen_step = best
    passed = chosen_result.passed
    if not passed and reason is None:
        reason = "no layer left to raise"
    record = {
        "repair": {
            "target_kld": target,
            "thresholds": {k: getattr(gate, k) for k in ("max_kld", "max_ppl_increase", "min_top1", "min_recovery")},
            "options": options.model_dump(),
            "attribution": first_attribution.to_json(),
            "steps": steps,
            "reattributed_after": reattributed,  # the failing steps attributed again
            "result": "passed" if passed else f"failed: {reason}",
            "chosen_step": chosen_step,
        },
        "gate": chosen_result.to_json(),
    }
    if chosen_dir == artifact:  # nothing better than the uniform artifact: copy it to hold the record
        chosen_dir = work / "step-0"
        remove_dir(chosen_dir, "repair work directory")
        shutil.copytree(artifact, chosen_dir)
    fields = {k: v for k, v in read_manifest(chosen_dir).items() if k not in ("files", "created", "versions")}
    write_manifest(chosen_dir, {**fields, **record})
    if not passed:
        reason = (
            f"repair could not reach KLD {target:g}: {reason}; closest KLD {chosen_result.metrics['kld_mean']:.5f} "
            f"at {size_mb(chosen_dir):.2f} MB"
        )
    return RepairOutcome(
        passed, chosen_dir, chosen_result, steps, first_attribution, None if passed else reason, raised
    )


def record_pass_without_repair(outcome: RepairOutcome) -> None:
    """The start passed the gate: its manifest records the gate and the one step all the same."""
    fields = {k: v for k, v in read_manifest(outcome.artifact).items() if k not in ("files", "created")}
    record = {"steps": outcome.steps, "result": "passed without repair"}
    write_manifest(outcome.artifact, {**fields, "repair": record, "gate": outcome.gate.to_json()})


def publish(source: Path, out: Path, what: str = "--out") -> None:
    """Move a finished artifact directory to `out` in one rename, replacing what is there only as
    artifacts.check_replaceable allows."""
    replace_dir(source, out, what)


def start_options(options, gate: GateOptions):
    """The quantize options repair starts from: as given, or with `start: smallest` every layer on
    the ladder's smallest rung (the method, format and calibration kept)."""
    repair_options = gate.repair or RepairOptions()
    if repair_options.start != "smallest":
        return options
    rung = smallest(repair_options.rungs, options.weights)
    return options.model_copy(update={"weights": rung.scheme(options.weights)})


def quantize_and_repair(
    model: str | Path, out: Path, options, gate: GateOptions, *, overwrite: bool = False, device: str = "auto", log=None
) -> RepairOutcome:
    """`optkit quantize --target-kld`: quantize into a work directory beside `out`, gate, repair;
    the artifact that passes goes to `out`, else the closest to `out.rejected` (never to `out`)."""
    from optkit.artifacts import check_output_dir, check_replaceable, scratch_dir
    from optkit.modeldir import resolve_model_dir
    from optkit.quant.quantize import quantize_model

    rejected = out.with_name(f"{out.name}.rejected")
    check_output_dir(out, overwrite)
    check_replaceable(rejected, "--out")  # where a failed repair goes, replaced as --out is
    check_mixed(options.format)
    base = resolve_model_dir(model)
    with scratch_dir(out) as work:
        quantize_model(base, work / "uniform", start_options(options, gate), overwrite=True, device=device)
        outcome = repair(work / "uniform", base, gate, work, log=log)
        if outcome.artifact == work / "uniform":  # passed as it was: record the gate all the same
            record_pass_without_repair(outcome)
        destination = out if outcome.passed else rejected
        publish(outcome.artifact, destination)
        outcome.artifact = destination
        return outcome
