"""Where the Triton kernel tests run: on CPU under Triton's interpreter, and on CUDA when there is one.

Import this before anything imports triton: the interpreter must be switched on (TRITON_INTERPRET=1,
set here when there is no GPU) before triton is first imported, as that decides how triton's own
helpers are built. A module importing this is skipped when triton is not installed."""

import os
import sys

import pytest
import torch

LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and not LATE
CPU_SKIP = "triton was imported before TRITON_INTERPRET=1 was set" if LATE else "CPU tensors need TRITON_INTERPRET=1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETING, reason=CPU_SKIP)),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]
