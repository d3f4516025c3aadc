"""What repair (pipeline/repair.py) reads and writes of a candidate: an artifact directory
(compressed-tensors, GPTQ: quant/mixed_artifact.py) or a GGUF file written with a K mix
(`quantize.gguf.type` Q3_K_M, Q4_K_M, ...: quant/mixed_gguf.py), whose linears climb ggml's types
(quant/ladder.py's GGUF_LADDER) one tensor at a time. llama.cpp keeps q/k/v and gate/up as separate
tensors of any types, so a GGUF linear moves alone; vLLM's fused shards move together."""

import os
import shutil
from pathlib import Path

from optkit.artifacts import file_sha256, replace_dir
from optkit.errors import OptkitError
from optkit.gate.options import RepairOptions
from optkit.manifest import read_manifest, write_manifest
from optkit.quant.formats.gguf_mix import FILE_TYPES, K_TYPES, GgufOptions, linear_scheme
from optkit.quant.formats.gguf_read import is_gguf
from optkit.quant.formats.mixed import check_mixed
from optkit.quant.ladder import GGUF_LADDER, Rung, parse_rung
from optkit.quant.mixed_artifact import WEIGHTS, write_mixed_artifact
from optkit.quant.mixed_gguf import gguf_manifest, write_mixed_gguf

SUFFIX = ".gguf"
# `start: smallest` on a GGUF rung: the file type whose linears are that type (llama-quantize's `_S` mixes)
SMALLEST_FILE_TYPE = {"Q2_K": "Q2_K", "Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S", "Q6_K": "Q6_K"}


def check_repairable(format_name: str, gguf: dict | None) -> None:
    """One line for an artifact repair cannot raise: a format without per-layer precision, or a
    GGUF file of a legacy type (Q4_0, Q4_1, Q8_0), whose blocks repair does not climb."""
    if format_name != "gguf":
        check_mixed(format_name)
        return
    file_type = (gguf or {}).get("type")
    if file_type not in FILE_TYPES or FILE_TYPES[file_type].default not in K_TYPES:
        raise OptkitError(
            f"repair climbs GGUF's K-quant ladder (Q2_K ... Q8_0, F16), not a {file_type or 'legacy'} file: "
            "set quantize.gguf.type to a K mix such as Q3_K_M or Q4_K_M"
        )


def repair_rungs(options: RepairOptions, gguf: bool) -> list[Rung]:
    """The ladder repair climbs: `precisions` as given, or for a GGUF file (`gguf`) ggml's types by
    default (a rung that is not a ggml type is one line naming the setting)."""
    if not gguf:
        return options.rungs
    if "precisions" not in options.model_fields_set:
        return [parse_rung(value) for value in GGUF_LADDER]
    rungs = options.rungs
    if any(rung.gguf_type is None and not rung.full for rung in rungs):
        raise OptkitError(f"gate.repair.precisions: a GGUF file's linears climb ggml's types: give {list(GGUF_LADDER)}")
    return rungs


def candidate_path(work: Path, name: str, like: Path) -> Path:
    """Where candidate `name` (step-3, ...) of an artifact like `like` goes: a directory or a .gguf."""
    return work / (f"{name}{SUFFIX}" if is_gguf(like) else name)


def artifact_bytes(artifact: Path) -> int:
    """What the size budget counts: the .gguf, or the directory's model.safetensors."""
    return (artifact if is_gguf(artifact) else artifact / WEIGHTS).stat().st_size


def candidate_manifest(artifact: Path) -> dict | None:
    return gguf_manifest(artifact) if is_gguf(artifact) else read_manifest(artifact)


def write_candidate(source: Path, base: Path, rungs: dict[str, Rung], out: Path) -> None:
    """`source` with the linears of `rungs` raised, written to `out`."""
    if is_gguf(source):
        write_mixed_gguf(source, base, rungs, out, {})
    else:
        write_mixed_artifact(source, base, rungs, out, {})


def copy_candidate(source: Path, out: Path) -> None:
    if is_gguf(source):
        shutil.copy2(source, out)
    else:
        shutil.copytree(source, out)


def rewrite_manifest(artifact: Path, base: Path, manifest: dict) -> None:
    """Replace the artifact's manifest (its optkit.json, or the file's `optkit.manifest` key)."""
    if is_gguf(artifact):
        write_mixed_gguf(artifact, base, {}, artifact, manifest)
    else:
        write_manifest(artifact, manifest)


def smallest_start(options, rung: Rung):
    """`start: smallest` for a GGUF K mix: the file type whose linears are all on `rung`."""
    file_type = SMALLEST_FILE_TYPE.get(rung.gguf_type or "")
    if file_type is None:
        raise OptkitError(f"gate.repair start: smallest starts a GGUF file on a K type, not {rung.label}")
    return options.model_copy(update={"gguf": GgufOptions(type=file_type), "weights": linear_scheme(file_type)})


def publish_candidate(candidate: Path, repaired: Path, name: str, holder: Path) -> Path:
    """Move the chosen candidate to `repaired` in one rename (a .gguf as `repaired/name`, through the
    new directory `holder`); returns the released artifact: the directory, or the file in it."""
    if not is_gguf(candidate):
        replace_dir(candidate, repaired)
        return repaired
    holder.mkdir()
    os.replace(candidate, holder / name)
    replace_dir(holder, repaired)
    return repaired / name


def released_manifest(artifact: Path) -> dict:
    """The manifest of what repair released; a .gguf's lists the file and its digest."""
    if not is_gguf(artifact):
        return read_manifest(artifact)
    return {**gguf_manifest(artifact), "files": {artifact.name: file_sha256(artifact)}}
