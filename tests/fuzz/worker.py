"""A long-lived process that feeds mutants to one of optkit's readers, under a cap on its address
space (RLIMIT_AS) and an alarm per mutant (5 s of CPU time), so that a mutant that exhausts memory, runs too long or
kills the process is an outcome, not the end of the test run.

    python tests/fuzz/worker.py READER SLOT MEMORY_MIB SECONDS VALID COMMANDS

READER is gguf, config, manifest or recipe; SLOT a directory of the files a mutant completes (the
model directory a config.json goes into, the artifact an optkit.json goes into), VALID a directory
of valid files (the seeds) and COMMANDS the JSON list of argv the CLI mutants run, each run once
before the cap and the alarm are set. Each stdin line is
a JSON request, {"path": MUTANT} for the reader or {"path": MUTANT, "argv": [...]} for `optkit ARGV`
run through the CLI's own entry point ("{path}" and "{slot}" in argv are filled in); each answer is
one JSON line on the original stdout:
  outcome: "ok" | "refused" (exit 2 with its line) | "failure" (any other exception: a bug) |
           "timeout" | "memory" ; line: the message; type: the exception's type;
  past_header: the mutant got past the header (GGUF: magic and version read, the metadata walked;
               JSON and YAML: the text parsed); seconds (of CPU time, which the alarm counts) and
  wall_seconds; and for argv: exit, stdout, stderr.
"""

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class MutantTimeout(BaseException):  # not an Exception: no reader's `except Exception` can swallow it
    pass


def _alarm(signum, frame):
    raise MutantTimeout


def gguf_reader(path: Path, slot: Path) -> list[str]:
    """What `optkit verify`, `optkit inspect` and `optkit eval` read of a .gguf (llama.cpp's load aside)."""
    from optkit.quant.formats import gguf_check, gguf_inspect, gguf_read

    notes = []
    result = gguf_check.check_file(path)
    notes.append("checked:" + ",".join(result.checked) + (":problems" if result.problems else ""))
    gguf_inspect.summary(path)
    notes.append("summary")
    gguf_read.read_file(path)
    notes.append("read")
    return notes


def config_reader(path: Path, slot: Path) -> list[str]:
    """What loading a model directory reads of its config.json."""
    from optkit.modeldir import check_model_dir, read_config
    from optkit.models.config import ModelConfig
    from optkit.quant.supported import require_supported

    shutil.copyfile(path, slot / "config.json")
    check_model_dir(slot)
    require_supported(slot, runtime=True)
    config = ModelConfig.from_hf(read_config(slot))
    config.rope_frequencies()
    config.local_rope_frequencies()
    return ["model_config"]


def manifest_reader(path: Path, slot: Path) -> list[str]:
    """What `optkit verify`, `optkit inspect` and the loader read of an artifact's optkit.json."""
    from optkit.cli.inspect import inspect
    from optkit.manifest import read_manifest, verify_files
    from optkit.modeldir import verify_weights

    shutil.copyfile(path, slot / "optkit.json")
    manifest = read_manifest(slot)
    problems = verify_files(slot, manifest)
    verify_weights(slot)
    with contextlib.redirect_stdout(io.StringIO()):
        inspect(str(slot), json_output=False)
    return ["differs" if problems else "verified", "inspected"]


def recipe_reader(path: Path, slot: Path) -> list[str]:
    """What `optkit run` reads of a recipe before it starts quantizing."""
    from optkit.cli.run import _recipe_model
    from optkit.pipeline.recipe import load_recipe

    _recipe_model(path, [])
    load_recipe(path)
    return ["validated"]


READERS = {"gguf": gguf_reader, "config": config_reader, "manifest": manifest_reader, "recipe": recipe_reader}


def past_header(reader: str, path: Path) -> bool:
    import struct

    data = path.read_bytes()
    if reader == "gguf":
        return len(data) >= 24 and data[:4] == b"GGUF" and struct.unpack_from("<I", data, 4)[0] in (2, 3)
    try:
        if reader == "recipe":
            import yaml

            yaml.load(data.decode("utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        else:
            json.loads(data)
        return True
    except Exception:  # noqa: BLE001 - not YAML or JSON, whatever the parser says
        return False


def classify(e: BaseException) -> tuple[str, str]:
    """(outcome, line) for an exception out of a reader, as the CLI's handler would see it."""
    from optkit.cli.main import describe_failure

    if isinstance(e, MutantTimeout):
        return "timeout", "no answer within the alarm"
    if isinstance(e, MemoryError) or "can't allocate memory" in str(e)[:500]:
        return "memory", f"{type(e).__name__}: {str(e)[:300]}"
    line, code = describe_failure(e) if isinstance(e, Exception) else (repr(e), 3)
    return ("refused" if code == 2 else "failure"), line


def run_reader(reader: str, path: Path, slot: Path) -> dict:
    try:
        notes = READERS[reader](path, slot)
        return {"outcome": "ok", "notes": notes}
    except BaseException as e:  # noqa: BLE001 - everything a reader raises is the outcome being measured
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
        outcome, line = classify(e)
        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if "/optkit/" in f.filename] or frames
        where = f"{ours[-1].filename.rsplit('/optkit/', 1)[-1]}:{ours[-1].lineno}" if ours else ""
        return {"outcome": outcome, "line": line[:100_000], "type": type(e).__name__, "where": where}


def run_cli(argv: list[str]) -> dict:
    from optkit.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    saved = sys.argv
    sys.argv = ["optkit", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    answer = {"outcome": "exit", "exit": code, "stdout": out.getvalue()[-20_000:], "stderr": err.getvalue()[-20_000:]}
    if "--json" in argv and out.getvalue().strip():
        answer["json_error"] = strict_json_error(out.getvalue())
    return answer


def strict_json_error(text: str) -> str | None:
    """Why `text` is not one JSON document a strict parser (JavaScript's JSON.parse) reads, or None."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    try:
        json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError) as e:
        return str(e)[:200]
    return None


def warm_up(reader: str, slot: Path, valid: Path, commands: list[list[str]]) -> None:
    """Run the reader on every valid file in `valid` (the seeds) and each command on the first, so
    that imports and first-call set-up (the first recipe in the compressed-tensors format imports
    that library: seconds) count neither against the alarm nor against the memory cap."""
    import torch

    torch.set_num_threads(1)
    files = sorted(valid.iterdir())
    for file in files:
        answer = run_reader(reader, file, slot)
        assert answer["outcome"] == "ok", (file, answer)
    run_reader(reader, files[0], slot)  # the slot holds the first seed for the commands
    for argv in commands:
        run_cli([a.replace("{path}", str(files[0])).replace("{slot}", str(slot)).replace("{n}", "warm") for a in argv])


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def serve(reader: str, slot: Path, memory_mib: int, seconds: float, valid: Path, commands: list[list[str]]) -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open(slot.parent / f"{reader}-worker.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)  # what C code prints (llama.cpp, compilers) goes to the log, not into the answers
    os.dup2(log, 2)
    os.chdir(slot.parent)
    warm_up(reader, slot, valid, commands)
    limit = _vm_bytes() + memory_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    # the alarm counts the CPU time the process spends (ITIMER_PROF), not the wall clock: on a
    # loaded machine a mutant that needs 0.5 s of work may take 5 s to get it
    signal.signal(signal.SIGPROF, _alarm)
    answers.write(json.dumps({"ready": True, "limit_mib": limit >> 20}) + "\n")
    for request_line in sys.stdin:
        request = json.loads(request_line)
        path = Path(request["path"])
        start, cpu_start = time.perf_counter(), time.process_time()
        signal.setitimer(signal.ITIMER_PROF, seconds)
        try:
            if "argv" in request:
                argv = [a.replace("{path}", str(path)).replace("{slot}", str(slot)) for a in request["argv"]]
                if reader in ("config", "manifest"):
                    shutil.copyfile(path, slot / ("config.json" if reader == "config" else "optkit.json"))
                answer = run_cli(argv)
            else:
                answer = run_reader(reader, path, slot)
        except MutantTimeout:
            answer = {"outcome": "timeout", "line": "no answer within the alarm"}
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        answer["seconds"] = round(time.process_time() - cpu_start, 3)
        answer["wall_seconds"] = round(time.perf_counter() - start, 3)
        signal.setitimer(signal.ITIMER_PROF, seconds)
        try:
            answer["past_header"] = past_header(reader, path)
        except MutantTimeout:
            answer["past_header"] = False
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    reader, slot, memory_mib, seconds, valid, commands = sys.argv[1:7]
    serve(reader, Path(slot), int(memory_mib), float(seconds), Path(valid), json.loads(commands))
