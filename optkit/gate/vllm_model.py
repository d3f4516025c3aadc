"""vLLM as the gate's artifact model (`optkit eval --engine vllm`): the artifact runs in vLLM's own
venv through optkit/engines/vllm.py, so the gate scores what vLLM's kernels compute.

With the base's top-k (--reference-cache, or the base run with top_k) the worker returns the
artifact's log-probs at those k ids only (`gather`); for the exact full-vocabulary KLD it returns
every log-prob (`__call__`). Either way vLLM-CPU computes all V log-probs per position and hands
them to the worker as Python lists (prompt_logprobs=-1), which is what costs at a large vocabulary
(docs/vllm.md); windows are sent in calls of at most CALL_BYTES of log-probs."""

from pathlib import Path
from types import SimpleNamespace

import torch

from optkit.engines.vllm import Gathered, Timeouts, VllmWorker, vllm_dtype
from optkit.modeldir import read_config

CALL_BYTES = 256 << 20  # fp32 log-probs per worker call: 1 window of 256 tokens at a 262k vocabulary


class VllmModel:
    """The artifact in one vLLM worker: model(input_ids [B, S]).logits [B, S, V] are log-probs (row
    S-1, which predicts past the window and which the gate drops, is zero), and gather()."""

    def __init__(
        self,
        artifact_dir: Path,
        python: Path,
        *,
        seq_len: int,
        kv_cache_dtype: str = "auto",
        timeouts: Timeouts = Timeouts(),
    ):
        self.dtype = vllm_dtype(read_config(artifact_dir).get("quantization_config"))
        self.kv_cache_dtype = kv_cache_dtype
        self.worker = VllmWorker(python, timeouts)
        try:  # a window of seq_len tokens, then the one token vLLM must generate
            self.info = self.worker.load(
                artifact_dir, dtype=self.dtype, max_model_len=seq_len + 1, kv_cache_dtype=kv_cache_dtype
            )
        except BaseException:
            self.worker.close()
            raise
        self.vocab_size = self.info["vocab_size"]

    @property
    def engine(self) -> dict:
        """What the report says ran the artifact."""
        return {"name": "vllm", "vllm": self.info["vllm"], "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype}

    def _calls(self, windows: torch.Tensor) -> list[slice]:
        per_call = max(1, CALL_BYTES // (windows.shape[1] * self.vocab_size * 4))
        return [slice(i, i + per_call) for i in range(0, len(windows), per_call)]

    def gather(self, windows: torch.Tensor, ids: torch.Tensor) -> Gathered:
        parts = [self.worker.score(windows[part], ids[part]) for part in self._calls(windows)]
        return Gathered(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logp_at_ids", "target_logp", "argmax")))

    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        parts = [self.worker.prompt_logprobs(input_ids[part])["logp"] for part in self._calls(input_ids)]
        logp = torch.cat(parts)
        return SimpleNamespace(logits=torch.cat([logp, logp.new_zeros(logp.shape[0], 1, logp.shape[2])], dim=1))

    def close(self) -> None:
        self.worker.close()
