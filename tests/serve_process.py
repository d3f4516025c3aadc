"""`optkit serve` as a real process for the end-to-end tests: start it on a free loopback port,
wait until it answers, stop it afterwards."""

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

try:
    import httpx2 as httpx
except ImportError:  # older openai releases depend on httpx itself
    import httpx

SERVE = [sys.executable, "-m", "optkit.cli.main", "serve"]
STARTUP_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(log_dir: Path, *args: str) -> Iterator[tuple[str, Path]]:
    """(base URL, log file) of `optkit serve ARGS` once it has said it is serving and answers
    /health; the process is stopped on exit."""
    port = free_port()
    log = log_dir / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([*SERVE, *args, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(process, base, log)
        yield base, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_ready(process: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"optkit serve exited with code {process.returncode}:\n{log.read_text()}")
        try:
            if "serving " in log.read_text() and httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"optkit serve did not answer /health within {STARTUP_S} s:\n{log.read_text()}")
