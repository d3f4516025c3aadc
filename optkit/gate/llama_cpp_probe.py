"""Does llama.cpp load a .gguf, and compute finite logits from it, without killing the process?

llama.cpp answers some files it cannot use with a GGML_ASSERT, which aborts the whole process
(`block_count 0`: GGML_ASSERT(n_layer > 0)), not with an exception. So the first load of any file
happens here, in a child process (`python -m optkit.gate.llama_cpp_probe PATH N_CTX`, torch-free):
its death by a signal becomes one line naming it, and only a file that loaded there is loaded
in-process (gate/llama_cpp.py). The child prints one JSON line: {"problem": null or a line}."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

PROBE_TEXT = "The quick brown fox jumps over the lazy dog."
PROBE_TOKENS = 8
TIMEOUT_S = 600  # a large file's first read from disk; a hang is named, not waited on for good
REASON_CHARS = 200


def probe_load(path: str | Path, n_ctx: int = 64, timeout_s: float = TIMEOUT_S) -> str | None:
    """None when llama.cpp, in a child process, loads `path` with a context of `n_ctx` and its logits
    for a few tokens are finite; else what went wrong, in one line (without the path)."""
    from optkit.text_safety import printable

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # ggml would attach gdb to print one
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "optkit.gate.llama_cpp_probe", str(path), str(n_ctx)]
    try:
        done = subprocess.run(
            command, capture_output=True, env=env, stdin=subprocess.DEVNULL, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not finish loading it within {timeout_s:g} s"
    stderr = done.stderr.decode("utf-8", "replace")
    reason = _reason(stderr)
    said = f": {printable(reason)[:REASON_CHARS]}" if reason else ""
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return f"llama.cpp crashed loading it ({name}{said}): the file is corrupted or not one llama.cpp supports"
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        return f"llama.cpp's loader exited with status {done.returncode} and no verdict{said}"
    return answer["problem"]


def _reason(stderr: str) -> str:
    """The line of llama.cpp's log (the child's stderr) that says why it stopped, or ""."""
    for marker in ("GGML_ASSERT", "what():", "error"):
        found = [line[line.index(marker) :].strip() for line in stderr.splitlines() if marker in line]
        if found:
            return found[-1]  # from the marker on: not the build's source path
    return ""


def _probe(path: str, n_ctx: int) -> str | None:
    """In the child. verbose: llama.cpp's log goes to stderr, where the parent finds the reason."""
    import numpy as np
    from llama_cpp import Llama

    from optkit.gate.llama_cpp_buffers import configure_llama_cpp

    configure_llama_cpp()
    try:
        llm = Llama(
            model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1, logits_all=True, verbose=True
        )
    except (ValueError, RuntimeError) as e:
        return f"llama.cpp does not load it ({e}): re-create it"
    try:
        ids = llm.tokenize(PROBE_TEXT.encode(), add_bos=False, special=True)[:PROBE_TOKENS] or [0]
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        vocab = llm.n_vocab()
    except (ValueError, RuntimeError) as e:
        return f"llama.cpp loads it but cannot evaluate {PROBE_TOKENS} tokens with it ({e})"
    finally:
        llm.close()
    if logits.shape[-1] != vocab or not np.isfinite(logits).all():
        return f"llama.cpp loads it but its logits for {len(ids)} tokens are not finite"
    return None


if __name__ == "__main__":
    problem = _probe(sys.argv[1], int(sys.argv[2]))
    sys.stdout.write("\n" + json.dumps({"problem": problem}) + "\n")
