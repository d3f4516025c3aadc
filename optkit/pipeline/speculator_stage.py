"""The recipe's `speculator:` stage: an EAGLE head for the artifact the release ships (trained on
the artifact's own features, or the section's `path`), a head for the base to compare with, their
acceptance on the gate's eval set, and `gate.min_acceptance_length` checked on the artifact's head.

What the report shows, at the section's num_speculative_tokens (greedy chains, simulated with the
target's transformers model: speculative/acceptance.py):
  base_head_on_base          what speculation gave before quantization
  base_head_on_artifact      the base's head served with the artifact: what quantization costs it
  artifact_head_on_artifact  the release's own head: what it gets back by training on the artifact
"""

import hashlib
import json
import time
from pathlib import Path

from optkit import __version__
from optkit.artifacts import content_sha256
from optkit.data.eval_sets import load_text_set
from optkit.modeldir import load_tokenizer
from optkit.speculative.acceptance import eval_prompts, mean_acceptance_length
from optkit.speculative.eagle_head import target_digest
from optkit.speculative.head_files import read_head
from optkit.speculative.options import SpeculatorSection, SpeculatorTrainOptions
from optkit.speculative.train import frozen_target, train_speculator

RELEASE_DIR = "speculator"  # the head's directory inside the release


def _digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _head_for(target: Path, given: str | None, out: Path, section: SpeculatorSection) -> Path:
    """The head given in the recipe, or one trained for `target` into `out` (kept for a rerun whose
    target and options are the same: its config names the target's digest)."""
    if given is not None:
        return Path(given)
    options = SpeculatorTrainOptions(**section.model_dump(exclude={"path", "base_path"}))
    record = out.parent / f"{out.name}.json"
    inputs = _digest({"optkit": __version__, "target": target_digest(target), "options": options.model_dump()})
    if record.is_file() and json.loads(record.read_text()).get("inputs") == inputs and (out / "config.json").is_file():
        return out
    train_speculator(target, out, options, overwrite=True)
    record.write_text(json.dumps({"inputs": inputs}) + "\n")
    return out


def speculator_stage(section: SpeculatorSection, gate, base: Path, artifact: Path, work: Path) -> tuple[Path, dict]:
    """Train (or take) the heads and measure them; returns the artifact's head directory and the
    report's `speculative` record (with its check when gate.min_acceptance_length is set)."""
    start = time.perf_counter()
    artifact_head = _head_for(artifact, section.path, work / "speculator", section)
    base_head = _head_for(base, section.base_path, work / "speculator-base", section)
    k = section.num_speculative_tokens
    prompts = eval_prompts(load_tokenizer(artifact), load_text_set(gate.eval_set).texts, section.eval_prompts, 64)
    base_model, artifact_model = frozen_target(base), frozen_target(artifact)
    base_eagle = read_head(base_head, base_model, base)
    artifact_eagle = read_head(artifact_head, artifact_model, artifact)  # refused if trained for another model

    def acceptance(head, model) -> float:
        return mean_acceptance_length(head, model, prompts, k, section.eval_new_tokens)

    record = {
        "num_speculative_tokens": k,
        "eval_set": gate.eval_set,
        "base_head_on_base": acceptance(base_eagle, base_model),
        "base_head_on_artifact": acceptance(base_eagle, artifact_model),
        "artifact_head_on_artifact": acceptance(artifact_eagle, artifact_model),
        "head_sha256": content_sha256(artifact_head),
    }
    limit = gate.min_acceptance_length
    if limit is not None:
        value = record["artifact_head_on_artifact"]
        passed = value >= limit
        record["check"] = {
            "name": "min_acceptance_length",
            "metric": "mean_acceptance_length",
            "value": value,
            "limit": limit,
            "passed": passed,
            "state": "ok" if passed else "crossed",
            "bound": None,
            "rule": f"≥ {limit:g}",
        }
    record["wall_time_s"] = round(time.perf_counter() - start, 2)
    return artifact_head, record


def with_speculative(gate: dict, record: dict) -> dict:
    """The gate's record with the speculative one; a failed min_acceptance_length check fails it."""
    gate = {**gate, "speculative": record}
    check = record.get("check")
    if check is not None:
        gate["checks"] = [*gate.get("checks", []), check]
        if not check["passed"]:
            gate["verdict"] = "fail"
    return gate


def copy_head(head: Path, release_tmp: Path) -> dict:
    """Put the head's files into the release (data only: its config.json and model.safetensors);
    returns the manifest's `speculator` entry."""
    import shutil

    from optkit.speculative.eagle_head import CONFIG, WEIGHTS

    (release_tmp / RELEASE_DIR).mkdir()
    for name in (CONFIG, WEIGHTS):
        shutil.copyfile(head / name, release_tmp / RELEASE_DIR / name)
    return {"path": RELEASE_DIR, "kind": "eagle1", "files": [f"{RELEASE_DIR}/{CONFIG}", f"{RELEASE_DIR}/{WEIGHTS}"]}


def acceptance_line(record: dict) -> str:
    """The report's line: what quantization did to speculation, and what the artifact's head gives."""
    return (
        f"EAGLE mean acceptance length at k={record['num_speculative_tokens']} ({record['eval_set']}): "
        f"base head on base {record['base_head_on_base']:.2f}, base head on artifact "
        f"{record['base_head_on_artifact']:.2f}, artifact's head on artifact {record['artifact_head_on_artifact']:.2f}"
    )
