"""A killed writer's temporary directory is removed by the next writer of the same output; one
that a live process owns is never touched."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from optkit.artifacts import OWNER, atomic_output_dir, remove_stale_temporaries
from tests.conftest import leftovers

# Writes OUT through atomic_output_dir, says "ready" once inside, and finishes when GO exists.
WRITER = """
import sys, time
from pathlib import Path
from optkit.artifacts import atomic_output_dir

out, go = Path(sys.argv[1]), Path(sys.argv[2])
with atomic_output_dir(out, overwrite=True) as tmp:
    (tmp / "spill.bin").write_bytes(b"x" * 1000)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.05)
    (tmp / "done").write_text("writer")
"""


def start_writer(out, go) -> tuple[subprocess.Popen, object]:
    """A process inside atomic_output_dir(out); returns it and its temporary directory."""
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(go)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    (tmp,) = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]
    return process, tmp


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_killed_writers_directory_is_removed_and_said_so(tmp_path, caplog, reaped):
    out = tmp_path / "q"
    process, stale = start_writer(out, tmp_path / "go")
    os.kill(process.pid, signal.SIGKILL)
    if reaped:
        process.wait()
    else:  # dead but not yet waited for: its pid still answers signals
        while (os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)) is None:
            time.sleep(0.01)
    assert (stale / "spill.bin").exists()
    with caplog.at_level(logging.WARNING, logger="optkit.artifacts"):
        with atomic_output_dir(out, overwrite=False) as tmp:
            (tmp / "f").write_text("1")
    process.wait()
    assert not stale.exists()
    assert leftovers(tmp_path, "q") == [out]
    assert [p.name for p in out.iterdir()] == ["f"]  # the owner record does not ship
    (line,) = caplog.messages
    assert f"removed stale temporary directory {stale}" in line and f"pid {process.pid}" in line


def test_a_live_writers_directory_is_left_alone(tmp_path, caplog):
    out = tmp_path / "q"
    go = tmp_path / "go"
    process, live = start_writer(out, go)
    try:
        with caplog.at_level(logging.WARNING, logger="optkit.artifacts"):
            remove_stale_temporaries(out)
            with atomic_output_dir(out, overwrite=True) as tmp:
                (tmp / "f").write_text("1")
                (tmp / "optkit.json").write_text(json.dumps({"files": {"f": ""}}))  # the writer may replace it
        assert (live / "spill.bin").exists() and caplog.messages == []
        go.touch()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.wait()
    assert (out / "done").read_text() == "writer"  # it finished undisturbed, after this one
    assert leftovers(tmp_path, "q") == [out]


def fake_temporary(parent, name, owner: dict | None):
    tmp = parent / f".{name}.tmp-test"
    tmp.mkdir()
    (tmp / "spill.bin").write_bytes(b"x")
    if owner is not None:
        (tmp / OWNER).write_text(json.dumps(owner))
    return tmp


def own_record(directory, **changes) -> dict:
    """The owner record this process writes, with `changes`."""
    with atomic_output_dir(directory / "probe", overwrite=False) as tmp:
        record = json.loads((tmp / OWNER).read_text())
    shutil.rmtree(directory / "probe")
    return {**record, **changes}


def test_a_reused_pid_does_not_keep_a_stale_directory(tmp_path, caplog):
    """The owner's pid now belongs to another process (this one, started at another time)."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("process start times come from Linux's /proc")
    stale = fake_temporary(tmp_path, "q", own_record(tmp_path, started="1"))
    with caplog.at_level(logging.WARNING, logger="optkit.artifacts"):
        remove_stale_temporaries(tmp_path / "q")
    assert not stale.exists() and "removed stale temporary directory" in caplog.text


@pytest.mark.parametrize(
    "owner,fragment",
    [
        (None, "names no owner process"),  # made by an older optkit, or one starting this instant
        ({"pid": 1, "host": "elsewhere", "started": None}, "pid 1 on host elsewhere"),  # shared disk
    ],
    ids=["no-owner", "other-host"],
)
def test_a_directory_whose_owner_cannot_be_checked_is_left_and_named(tmp_path, caplog, owner, fragment):
    kept = fake_temporary(tmp_path, "q", owner)
    with caplog.at_level(logging.WARNING, logger="optkit.artifacts"):
        with atomic_output_dir(tmp_path / "q", overwrite=False) as tmp:
            (tmp / "f").write_text("1")
    assert (kept / "spill.bin").exists()
    (line,) = caplog.messages
    assert f"left {kept} alone" in line and fragment in line


def test_only_the_same_outputs_temporaries_are_considered(tmp_path, caplog):
    other = fake_temporary(tmp_path, "q2", own_record(tmp_path, pid=2**22 + 1))  # dead pid, but q2 is not q
    with caplog.at_level(logging.WARNING, logger="optkit.artifacts"):
        remove_stale_temporaries(tmp_path / "q")
    assert other.exists() and caplog.messages == []


def test_optkit_quantize_removes_a_killed_runs_leftovers(tmp_path, draft_dir):
    """End to end, in a fresh process: the log line reaches the terminal."""
    out = tmp_path / "q"
    writer, stale = start_writer(out, tmp_path / "go")
    writer.kill()
    writer.wait()
    result = subprocess.run(
        [sys.executable, "-m", "optkit.cli.main", "quantize", str(draft_dir), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert f"removed stale temporary directory {stale} from an interrupted run (pid {writer.pid})" in result.stderr
    assert leftovers(tmp_path, "q") == [out]
