"""`optkit serve` refuses a model whose config.json gives an impossible size when it loads it: it
exits 2 with one line and never starts serving (a `hidden_size: 0` model with zero-size weights once
passed /health and then killed the server with SIGFPE in the C++ RMSNorm at the first completion)."""

import json
import shutil
import subprocess
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.serve_process import SERVE, free_port

STARTUP_S = 180
HIDDEN_INPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # [out, hidden]
HIDDEN_OUTPUT = ("o_proj", "down_proj")  # [hidden, in]


def zero_width_model(source, target):
    """`source` with hidden_size 0 and every weight shaped by it: what the model's config says, so
    that only the check of the size itself can refuse it."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "hidden_size": 0}))
    with safe_open(target / "model.safetensors", framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    for key, tensor in tensors.items():
        module = key.rsplit(".", 2)[-2]
        if module.endswith("norm"):
            shape = (0,)
        elif module in HIDDEN_INPUT or module in ("embed_tokens", "lm_head"):
            shape = (tensor.shape[0], 0)
        elif module in HIDDEN_OUTPUT:
            shape = (0, tensor.shape[1])
        else:
            raise AssertionError(f"a tensor this test does not know how to shape: {key}")
        tensors[key] = torch.zeros(shape, dtype=tensor.dtype)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_model_of_hidden_size_0_never_serves(tmp_path, draft_dir):
    model = zero_width_model(draft_dir, tmp_path / "zero-width")
    log = tmp_path / "serve.log"
    args = [*SERVE, str(model), "--port", str(free_port())]
    with open(log, "w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while process.poll() is None and time.monotonic() < deadline:
            assert "serving " not in log.read_text(), f"it started serving the model:\n{log.read_text()}"
            time.sleep(0.2)
        assert process.returncode == 2, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hidden_size" in errors[0], text
    assert "Traceback" not in text and "serving " not in text
