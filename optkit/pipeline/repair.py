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
   the gate's set), write that artifact (quant/mixed_artifact.py; a GGUF K mix's file,
   quant/mixed_gguf.py, whose linears climb ggml's types: pipeline/repair_artifact.py) and gate
   it. If it fails, attribute that candidate again and plan the next moves from it (`reattribute`, the default), or
   refit the rescaling to what the gate measured and take more moves of the first plan. With
   `reattribute`, a plan whose every move together is not predicted to reach the target aims at a
   waypoint instead (a quarter of the KLD it starts from). Once one passes, spend up to
   `shrink_evaluations` on shorter prefixes of the moves, each chosen by interpolating the gate's
   KLD between the last failing and the last passing prefix in the cumulative estimated drop
   (regula falsi), and keep the smallest artifact that passes. Every evaluation is a step in the manifest.
   A candidate the gate calls inconclusive (`decision: confident` on `max_windows` windows) is
   gated again on the whole eval set before repair climbs from it (`settle`).

Why attribute again: the estimate is a first-order step from the attributed weights, good near
them. The default 2-bit start sits far above a usual target, so the first plan must remove nearly
all of the KLD on the estimate's word and a small relative error in it is a large share of the
target; the first failing candidate is a much closer point to linearize at, and attributing again
there gives smaller artifacts. Far below the start no plan reaches the target on the estimate, and
taking every move would put every layer in full precision; waypoints get there smaller
(docs/results.md, "Numbers moved out of the code").
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

from optkit.artifacts import remove_dir, replace_dir
from optkit.errors import OptkitError
from optkit.gate.attribution import Attribution, attribute
from optkit.gate.evaluate import GateResult, evaluate
from optkit.gate.options import GateOptions, RepairOptions
from optkit.modeldir import weight_files
from optkit.pipeline.repair_artifact import (
    artifact_bytes,
    candidate_manifest,
    candidate_path,
    check_repairable,
    copy_candidate,
    repair_rungs,
    rewrite_manifest,
    smallest_start,
    write_candidate,
)
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
from optkit.quant.formats.gguf_read import is_gguf
from optkit.quant.formats.mixed import check_mixed
from optkit.quant.ladder import Rung, smallest
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
    return artifact_bytes(artifact) / 2**20


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


THRESHOLDS = ("max_kld", "max_ppl_increase", "min_top1", "min_recovery")  # the record's copy of the gate's


@dataclass
class _Candidate:
    """The best artifact so far: the smallest that passed, or, while none has, the lowest KLD."""

    kld: float
    directory: Path
    gate: GateResult
    raised: dict[str, Rung]
    step: int


class _Search:
    """Repair's state between gate evaluations (module doc, step 3). The plan's moves start from
    `source` (the artifact, or the last failing candidate attributed again), whose layers are
    already raised as in `prior`; its gate KLD is `source_kld`. `taken` is the prefix of the moves
    gated last; `failed_count` and `failed_kld` are the largest prefix that failed and its KLD."""

    def __init__(self, artifact: Path, manifest: dict, base: Path, gate: GateOptions, work: Path, result, steps, log):
        self.artifact, self.base, self.gate, self.work, self.steps, self.log = artifact, base, gate, work, steps, log
        self.options = options = gate.repair or RepairOptions()
        self.one_file = is_gguf(artifact)  # a GGUF file: its linears climb ggml's types, each on its own
        self.rungs = repair_rungs(options, self.one_file)
        self.target = target_kld(gate, result)
        self.attribution = self.first_attribution = self.attribute_at(artifact)  # the record's: the artifact as given
        self.itemsize = weight_itemsizes(base)
        self.moves = plan_moves(self.attribution, manifest, self.itemsize, self.rungs, alone=self.one_file)
        self.budget = math.inf if options.max_size_mb is None else options.max_size_mb * 2**20
        kld = result.metrics["kld_mean"]
        self.rescale = gate_rescale(kld, self.attribution.kld)
        self.best = _Candidate(kld, artifact, result, {}, 0)
        self.source, self.prior, self.source_kld = artifact, {}, kld
        self.taken: list[Move] = []
        self.failed_count, self.failed_kld = 0, kld
        self.evaluation = 0
        self.reattributed: list[int] = []

    def attribute_at(self, candidate: Path) -> Attribution:
        o = self.options
        return attribute(
            candidate, self.base, windows=o.windows, seq_len=self.gate.seq_len, exact=o.exact_swaps, rungs=self.rungs
        )

    def climb(self) -> str | None:
        """Gate longer prefixes of the plan until one passes (then shrink); returns why it stopped
        short of a pass, or None once one passed."""
        while self.evaluation < self.options.max_evaluations:
            room = self.budget - artifact_bytes(self.source)
            aim = aim_kld(self.target, self.source_kld, self.rescale, self.moves, self.options.reattribute)
            chosen, over_budget = extend_prefix(self.taken, self.moves, self.source_kld, self.rescale, aim, room)
            if len(chosen) == len(self.taken):
                spent = f"the size budget ({self.options.max_size_mb} MB) is spent"
                return spent if over_budget else "no layer left to raise"
            result = self.trial(chosen, self.taken)
            if result.passed:
                self.shrink(chosen, result.metrics["kld_mean"])
                return None
            self.learn_from_failure(chosen, result.metrics["kld_mean"])
        return f"{self.options.max_evaluations} gate evaluations (max_evaluations) did not reach it"

    def trial(self, moves: list[Move], previous: list[Move]) -> GateResult:
        """Write and gate the source with `moves` taken (a step of the record); keep it if best."""
        self.evaluation += 1
        raised = {**self.prior, **raised_rungs(moves)}
        out = candidate_path(self.work, f"step-{self.evaluation}", self.artifact)
        write_candidate(self.source, self.base, raised_rungs(moves), out)
        result = settle(out, self.base, self.gate, evaluate(out, self.base, self.gate), self.log)
        before = {**self.prior, **raised_rungs(previous)}
        changed = sorted(n for n in raised.keys() | before.keys() if raised.get(n) != before.get(n))
        self.steps.append(_step(self.evaluation, raised, result, out, changed))
        kld = result.metrics["kld_mean"]
        self.log(
            f"repair step {self.evaluation}: raised {len(raised)} linears, KLD {kld:.5f} "
            f"(target {self.target:g}), {self.steps[-1]['size_mb']:.2f} MB: {result.verdict}"
        )
        best = self.best
        smaller = result.passed and (not best.gate.passed or size_mb(out) < size_mb(best.directory))
        if smaller or (not best.gate.passed and kld < best.kld):
            self.best = _Candidate(kld, out, result, raised, self.evaluation)
        return result

    def shrink(self, chosen: list[Move], passing_kld: float) -> None:
        """Spend `shrink_evaluations` on shorter prefixes, between the last failing one and the
        passing `chosen` (regula falsi in the cumulative estimated drop)."""
        passing = len(chosen)
        for _ in range(self.options.shrink_evaluations):
            if passing - self.failed_count <= 1 or self.evaluation >= self.options.max_evaluations:
                break
            k = secant_prefix(
                chosen, self.failed_count, self.failed_kld, passing, passing_kld, SHRINK_AIM * self.target
            )
            shorter = self.trial(chosen[:k], chosen[:passing])
            if shorter.passed:
                passing, passing_kld = k, shorter.metrics["kld_mean"]
            else:
                self.failed_count, self.failed_kld = k, shorter.metrics["kld_mean"]

    def learn_from_failure(self, chosen: list[Move], kld: float) -> None:
        """`chosen` failed at `kld`: attribute that candidate again and plan from it (`reattribute`),
        or refit the rescaling to what the gate measured."""
        self.failed_count, self.failed_kld = len(chosen), kld
        self.taken = chosen
        if kld <= self.target:  # another threshold failed: aim lower
            self.target = 0.8 * kld
        if self.options.reattribute and self.evaluation < self.options.max_evaluations:
            self.replan_from_last_step()
        else:
            self.rescale = refit_rescale(self.rescale, self.source_kld, kld, self.taken)

    def replan_from_last_step(self) -> None:
        """Linearize again at the last failing candidate: it becomes the source of a new plan."""
        self.source = candidate_path(self.work, f"step-{self.evaluation}", self.artifact)
        self.prior, self.source_kld = {**self.prior, **raised_rungs(self.taken)}, self.failed_kld
        self.attribution = self.attribute_at(self.source)
        manifest = candidate_manifest(self.source)
        self.moves = plan_moves(self.attribution, manifest, self.itemsize, self.rungs, alone=self.one_file)
        self.rescale = gate_rescale(self.source_kld, self.attribution.kld)
        self.taken, self.failed_count = [], 0
        self.reattributed.append(self.evaluation)

    def finish(self, reason: str | None) -> RepairOutcome:
        """Write the whole record into the chosen artifact's optkit.json and name the outcome."""
        best, gate = self.best, self.gate
        passed = best.gate.passed
        if not passed and reason is None:
            reason = "no layer left to raise"
        record = {
            "repair": {
                "target_kld": self.target,
                "thresholds": {k: getattr(gate, k) for k in THRESHOLDS},
                "options": self.options.model_dump(),
                "attribution": self.first_attribution.to_json(),
                "steps": self.steps,
                "reattributed_after": self.reattributed,  # the failing steps attributed again
                "result": "passed" if passed else f"failed: {reason}",
                "chosen_step": best.step,
            },
            "gate": best.gate.to_json(),
        }
        chosen_dir = best.directory
        if chosen_dir == self.artifact:  # nothing better than the uniform artifact: copy it to hold the record
            chosen_dir = candidate_path(self.work, "step-0", self.artifact)
            remove_dir(chosen_dir, "repair work directory")
            copy_candidate(self.artifact, chosen_dir)
        fields = {k: v for k, v in candidate_manifest(chosen_dir).items() if k not in ("files", "created", "versions")}
        rewrite_manifest(chosen_dir, self.base, {**fields, **record})
        if not passed:
            reason = (
                f"repair could not reach KLD {self.target:g}: {reason}; closest KLD {best.kld:.5f} "
                f"at {size_mb(chosen_dir):.2f} MB"
            )
        return RepairOutcome(
            passed, chosen_dir, best.gate, self.steps, self.first_attribution, None if passed else reason, best.raised
        )


def repair(
    artifact: Path, base: Path, gate: GateOptions, work: Path, *, initial: GateResult | None = None, log=None
) -> RepairOutcome:
    """Gate `artifact`; if it fails, repair it into `work/step-N` directories (module doc). The
    outcome names the artifact that passed or, failing that, the one with the lowest KLD; its
    optkit.json holds the whole record."""
    log = log or (lambda line: None)
    manifest = candidate_manifest(artifact)
    if manifest is None:
        raise OptkitError(f"{artifact} has no optkit.json: repair starts from an optkit artifact")
    check_repairable(manifest["format"], manifest["options"].get("gguf"))
    result = settle(artifact, base, gate, initial or evaluate(artifact, base, gate), log)
    steps = [_step(0, {}, result, artifact, [])]
    if result.passed:
        return RepairOutcome(True, artifact, result, steps)
    search = _Search(artifact, manifest, base, gate, work, result, steps, log)
    return search.finish(search.climb())


def record_pass_without_repair(outcome: RepairOutcome, base: Path) -> None:
    """The start passed the gate: its manifest records the gate and the one step all the same."""
    fields = {k: v for k, v in candidate_manifest(outcome.artifact).items() if k not in ("files", "created")}
    record = {"steps": outcome.steps, "result": "passed without repair"}
    rewrite_manifest(outcome.artifact, base, {**fields, "repair": record, "gate": outcome.gate.to_json()})


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
    if options.format == "gguf":
        return smallest_start(options, smallest(repair_rungs(repair_options, True), options.weights))
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
    if options.format == "gguf":
        raise OptkitError(
            "--target-kld repairs artifact directories: repair a GGUF K mix with gate.repair in a recipe (optkit run)"
        )
    check_mixed(options.format)
    base = resolve_model_dir(model)
    with scratch_dir(out) as work:
        quantize_model(base, work / "uniform", start_options(options, gate), overwrite=True, device=device)
        outcome = repair(work / "uniform", base, gate, work, log=log)
        if outcome.artifact == work / "uniform":  # passed as it was: record the gate all the same
            record_pass_without_repair(outcome, base)
        destination = out if outcome.passed else rejected
        publish(outcome.artifact, destination)
        outcome.artifact = destination
        return outcome
