"""`optkit run RECIPE`: quantize -> gate -> compile -> package, each stage skipped when its inputs
are unchanged (compile runs only for a recipe with a `compile:` section and an artifact that passed).

Compile warms this machine's own compile cache (runtime/compile_cache.py) and the release records
what was warmed, as plain data in optkit.json's "compile"; the release carries no torch cache
(they are pickles: code), so the serving machine runs `optkit compile` itself.

Stage outputs live in a work directory beside the release (`.NAME.work/`); each finished stage
leaves a record of the hash of its inputs. A rerun whose inputs match skips the stage; an
interrupted run leaves no record for the stage it was in, so the rerun redoes exactly that stage.
"""

import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from optkit import __version__
from optkit.artifacts import (
    atomic_output_dir,
    check_output_dir,
    check_work_dir,
    check_writable_dir,
    content_sha256,
    file_sha256,
    remove_stale_temporaries,
    scratch_dir,
)
from optkit.errors import OptkitError
from optkit.gate.evaluate import GateResult, evaluate
from optkit.json_strict import dumps
from optkit.manifest import MANIFEST, read_manifest, verify_files, write_manifest
from optkit.modeldir import read_config, resolve_model_dir
from optkit.pipeline.gate_engine import gate_engine
from optkit.pipeline.model_card import model_card
from optkit.pipeline.recipe import Recipe
from optkit.pipeline.report_html import render_report
from optkit.pipeline.speculator_stage import copy_head, speculator_stage, with_speculative
from optkit.pipeline.vllm_deploy import vllm_config, write_vllm_deploy
from optkit.quant.formats import get_format
from optkit.quant.quantize import quantize_model
from optkit.runtime.compile_cache import MANIFEST as COMPILE_MANIFEST
from optkit.runtime.compile_cache import cache_key, cache_path
from optkit.runtime.engine_args import EngineArgs
from optkit.runtime.warmup import compile_model


@dataclass
class RunResult:
    release: Path
    verdict: str  # "released" | "rejected" | "inconclusive" (gate.decision confident: the eval set cannot tell)
    stages: list[dict] = field(default_factory=list)
    gate: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == "released"

    @property
    def exit_code(self) -> int:
        return {"released": 0, "rejected": 1, "inconclusive": 4}[self.verdict]

    def ran(self, stage: str, start: float) -> None:
        self.stages.append({"stage": stage, "status": "ran", "seconds": round(time.perf_counter() - start, 2)})

    def skipped(self, stage: str, status: str = "skipped") -> None:
        self.stages.append({"stage": stage, "status": status, "seconds": 0.0})


RELEASE_VERDICTS = {"pass": "released", "fail": "rejected", "inconclusive": "inconclusive"}


def release_verdict(gate: dict) -> str:
    """The release's verdict from its gate's (a gate record without one is never released)."""
    return RELEASE_VERDICTS.get(gate.get("verdict"), "rejected")


def require_thresholds(recipe: Recipe) -> None:
    """A release gate asked nothing approves nothing: a recipe must set a threshold."""
    if not recipe.gate.any_set():
        raise OptkitError(
            "the recipe's gate sets no threshold, so it could approve anything: add gate.max_kld "
            "(or gate.max_ppl_increase, gate.min_top1, or gate.task with gate.min_recovery)"
        )


def _digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _record(work: Path, stage: str) -> dict | None:
    path = work / f"{stage}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _write_record(work: Path, stage: str, record: dict) -> None:
    # a new file (O_EXCL), so that nothing planted in the work directory is written through
    with tempfile.NamedTemporaryFile("w", dir=work, prefix=f".{stage}.json.", delete=False) as tmp:
        tmp.write(dumps(record, indent=2, default=str) + "\n")
    Path(tmp.name).replace(work / f"{stage}.json")


def _git_commit(directory: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def _prepare_outputs(release: Path, what: str) -> Path:
    """Check every path the run writes before any work (`what` names the setting that chose the
    release: the recipe's `output` or --out), make the work directory, and clear what a killed run
    left there; returns the work directory."""
    check_output_dir(release, overwrite=True, what=what)
    work = release.parent / f".{release.name}.work"
    check_work_dir(work, f"{what} {release}")
    check_writable_dir(work, what)
    work.mkdir(parents=True, exist_ok=True)
    for output in (work / "quantized", work / "repair-steps", release):
        remove_stale_temporaries(output)
    return work


def run_recipe(
    recipe: Recipe, raw: dict, *, recipe_path: Path, out: Path | None = None, device: str = "auto"
) -> RunResult:
    require_thresholds(recipe)
    release = Path(out or recipe.output)
    what = "--out" if out else "output"
    work = _prepare_outputs(release, what)
    base = resolve_model_dir(recipe.model)
    if recipe.deploy is not None:  # a split the model's heads or layers cannot take fails before any work
        vllm_config(recipe.deploy, read_config(base), release.name)
    result = RunResult(release, "rejected")
    staged = _quantize_stage(recipe, base, work, result, device)
    _gate_stage(recipe, base, staged, work, result)
    # repair: the recipe asks the gate to raise the layers that caused the failure, or (start:
    # smallest) for the smallest mixed artifact that passes, whatever the gate said of this one
    repair_options = recipe.gate.repair
    if repair_options is not None and (not result.passed or repair_options.start == "smallest"):
        staged.artifact, staged.manifest = _repair_stage(recipe, base, staged, work, result, device)
    head = _speculator_stage(recipe, base, staged.artifact, work, result) if recipe.speculator else None
    # compile: only what will be released is worth warming
    compiled = _compile_stage(recipe, staged.manifest, staged.artifact, work, result) if recipe.compile else None
    _package_stage(recipe, raw, recipe_path, staged, compiled, result, what, head)
    return result


def _speculator_stage(recipe: Recipe, base: Path, artifact: Path, work: Path, result: RunResult) -> Path:
    """The release's EAGLE head and its acceptance (pipeline/speculator_stage.py), into the gate's record."""
    start = time.perf_counter()
    head, record = speculator_stage(recipe.speculator, recipe.gate, base, artifact, work)
    result.gate = with_speculative(result.gate, record)
    result.verdict = release_verdict(result.gate)
    result.ran("speculator", start)
    return head


@dataclass
class _Staged:
    """The artifact the stages hand on: a directory, or one file (GGUF) whose manifest lives in
    the quantize stage's record."""

    artifact: Path
    manifest: dict
    one_file: bool


def _quantize_stage(recipe: Recipe, base: Path, work: Path, result: RunResult, device: str) -> _Staged:
    """Quantize the base into the work directory, unless the last run did with these inputs and
    its artifact is intact."""
    start = time.perf_counter()
    inputs = _digest({"optkit": __version__, "base": content_sha256(base), "quantize": recipe.quantize.model_dump()})
    fmt = get_format(recipe.quantize.format)
    one_file = fmt.SUFFIX is not None  # GGUF: one file; its manifest lives in the record
    artifact = work / (f"model{fmt.SUFFIX}" if one_file else "quantized")
    done = _record(work, "quantize")
    manifest = _intact_manifest(artifact, one_file, done)
    if done and done["inputs"] == inputs and manifest:
        result.skipped("quantize")
        return _Staged(artifact, manifest, one_file)
    manifest = quantize_model(base, artifact, recipe.quantize, overwrite=True, device=device)
    if one_file:  # the file is the artifact: its digest replaces the staged directory's
        manifest = {**manifest, "files": {artifact.name: file_sha256(artifact)}}
    _write_record(work, "quantize", {"inputs": inputs, **({"manifest": manifest} if one_file else {})})
    result.ran("quantize", start)
    return _Staged(artifact, manifest, one_file)


def _intact_manifest(artifact: Path, one_file: bool, done: dict | None) -> dict | None:
    """The manifest of the artifact the last run left, when every file is as it lists; else None."""
    if one_file:
        intact = (
            done
            and artifact.is_file()
            and done.get("manifest", {}).get("files") == {artifact.name: file_sha256(artifact)}
        )
        return done["manifest"] if intact else None
    manifest = read_manifest(artifact) if artifact.exists() else None
    return manifest if manifest and not verify_files(artifact, manifest) else None


def _gate_stage(recipe: Recipe, base: Path, staged: _Staged, work: Path, result: RunResult) -> None:
    """Gate the artifact (or take the last run's verdict on the same inputs); sets the run's verdict."""
    start = time.perf_counter()
    gate, manifest = recipe.gate, staged.manifest
    inputs = _digest(
        {"artifact": manifest["files"], "base": manifest["base_model"]["sha256"], "gate": gate.model_dump()}
    )
    done = _record(work, "gate")
    if done and done["inputs"] == inputs:
        result.gate = done["result"]
        result.skipped("gate")
    else:
        with gate_engine(staged.artifact, gate.engine, task=gate.task, seq_len=gate.seq_len) as (model, engine):
            outcome: GateResult = evaluate(staged.artifact, base, gate, artifact_model=model, engine=engine)
        result.gate = outcome.to_json()
        _write_record(work, "gate", {"inputs": inputs, "result": result.gate})
        result.ran("gate", start)
    result.verdict = release_verdict(result.gate)


def _package_stage(
    recipe: Recipe,
    raw: dict,
    recipe_path: Path,
    staged: _Staged,
    compiled: dict | None,
    result: RunResult,
    what: str,
    head: Path | None = None,
) -> None:
    """Write the release: always (cheap), so that it reflects this recipe and verdict."""
    start = time.perf_counter()
    manifest = staged.manifest
    with atomic_output_dir(result.release, overwrite=True, what=what) as tmp:
        for path in [staged.artifact] if staged.one_file else staged.artifact.iterdir():
            if path.is_file() and path.name != MANIFEST:
                shutil.copy2(path, tmp / path.name)
        (tmp / "gate.json").write_text(dumps(result.gate, indent=2) + "\n")
        speculator = {"speculator": copy_head(head, tmp)} if head is not None else {}
        card = model_card(recipe, manifest, result.gate, result.verdict)
        if recipe.deploy is not None:
            card += write_vllm_deploy(tmp, recipe.deploy, result.release.name)
        (tmp / "README.md").write_text(card)
        (tmp / "report.html").write_text(render_report(result.release.name, manifest, result.gate, result.verdict))
        fields = {k: v for k, v in manifest.items() if k not in ("files", "optkit_version", "created", "versions")}
        write_manifest(
            tmp,
            {
                **fields,
                "recipe": raw,
                "recipe_path": str(recipe_path),
                "recipe_git_commit": _git_commit(recipe_path.resolve().parent),
                "gate": result.gate,
                "verdict": result.verdict,
                "compile": compiled,
                **speculator,
            },
        )
    result.ran("package", start)


def _repair_stage(recipe: Recipe, base: Path, staged: _Staged, work: Path, result: RunResult, device: str):
    """Repair the artifact the gate rejected (pipeline/repair.py) into work/repaired (a .gguf: the
    file in it); returns the artifact and manifest to package, and sets the run's gate result and
    verdict to the repaired's."""
    from optkit.pipeline.repair import record_pass_without_repair, repair, start_options
    from optkit.pipeline.repair_artifact import candidate_path, copy_candidate, publish_candidate, released_manifest

    start = time.perf_counter()
    artifact, one_file = staged.artifact, staged.one_file
    inputs = _digest({"artifact": staged.manifest["files"], "gate": recipe.gate.model_dump()})
    repaired = work / "repaired"
    released = repaired / artifact.name if one_file else repaired
    done = _record(work, "repair")
    kept = _intact_manifest(released, one_file, done) if done and done["inputs"] == inputs else None
    if kept:
        result.skipped("repair")
        engine_gate = done.get("engine_gate")
    else:
        with scratch_dir(work / "repair-steps") as steps:
            if recipe.gate.repair.start == "smallest":  # every layer on the ladder's smallest rung first
                artifact = candidate_path(steps, "start", artifact)
                options = start_options(recipe.quantize, recipe.gate)
                quantize_model(base, artifact, options, overwrite=True, device=device)
            outcome = repair(artifact, base, recipe.gate, steps)
            if outcome.artifact == artifact:  # it passed as it was: package a copy, keep the stage's
                outcome.artifact = candidate_path(steps, "as-is", artifact)
                copy_candidate(artifact, outcome.artifact)
                record_pass_without_repair(outcome, base)
            publish_candidate(outcome.artifact, repaired, released.name, steps / "released")
        kept = released_manifest(released)
        engine_gate = _engine_gate(recipe, base, released)
        record = {"inputs": inputs, "engine_gate": engine_gate, **({"manifest": kept} if one_file else {})}
        _write_record(work, "repair", record)
        result.ran("repair", start)
    result.gate = engine_gate or kept["gate"]
    result.verdict = release_verdict(result.gate)
    return released, kept


def _engine_gate(recipe: Recipe, base: Path, repaired: Path) -> dict | None:
    """Repair searches with the artifact's default engine (one load per candidate); where the recipe
    names another (`gate.engine: vllm`), the artifact repair chose is gated once more through it, and
    that is the release's verdict. None where the search already ran on the recipe's engine."""
    gate = recipe.gate
    if gate.engine in (None, "transformers", "llama.cpp"):
        return None
    with gate_engine(repaired, gate.engine, task=gate.task, seq_len=gate.seq_len) as (model, engine):
        outcome = evaluate(repaired, base, gate, artifact_model=model, engine=engine)
    return {**outcome.to_json(), "repair_engine": "transformers"}


def _compile_stage(recipe: Recipe, manifest: dict, artifact: Path, work: Path, result: RunResult) -> dict | None:
    """Warm the artifact (`optkit compile`) into this machine's compile cache; returns the warm-up
    record for the release's manifest, or None when the gate rejected the artifact."""
    start = time.perf_counter()
    if not result.passed:
        result.skipped("compile", "skipped (rejected)")
        return None
    options = recipe.compile
    args = EngineArgs(
        device=options.device,
        dtype=options.dtype or "auto",
        torch_compile=options.torch_compile,
        max_num_seqs=max(options.batch_sizes),  # room for the largest batch size
    )
    config = args.engine_config()
    device = config.device
    inputs = _digest({"artifact": manifest["files"], "compile": options.model_dump(), "key": cache_key(device)})
    done = _record(work, "compile")
    warm = (cache_path(artifact, device) / COMPILE_MANIFEST).is_file()
    if done and done["inputs"] == inputs and "result" in done and warm:
        result.skipped("compile")
        return done["result"]
    record = compile_model(str(artifact), options.batch_sizes, config, log_line=lambda line: None)
    record.pop("path")  # this machine's cache: no business of the release
    _write_record(work, "compile", {"inputs": inputs, "result": record})
    result.ran("compile", start)
    return record
