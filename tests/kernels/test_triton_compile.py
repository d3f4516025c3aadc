"""Every Triton kernel compiles for Hopper (sm_90a) with the configs its wrapper picks, on a machine
without a GPU: bench/gpu/compile_check.py in a fresh process (the interpreter must be off there)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    # Only look for triton here: importing it in this process would fix the interpreter mode
    # (TRITON_INTERPRET) before the other kernel tests choose it.
    spec = importlib.util.find_spec("triton")
    if spec is None:
        pytest.skip("triton is not installed")
    if not any((Path(p) / "backends" / "nvidia").is_dir() for p in spec.submodule_search_locations or []):
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/compile_check.py"), "--no-usage"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "FAILED" not in result.stdout
