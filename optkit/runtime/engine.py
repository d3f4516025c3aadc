"""The engine: scheduler -> model runner -> sampler -> scheduler, one step at a time.

`LLMEngine` is the synchronous core (offline batches, `optkit generate`); `async_engine.AsyncEngine`
runs it on its own thread for the server (docs/runtime.md, "The engine's front").
"""

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from optkit.errors import OptkitError
from optkit.runtime.block_manager import BlockManager
from optkit.runtime.detokenizer import Detokenizer
from optkit.runtime.sampler import Sampler, TokenLogprobs
from optkit.runtime.scheduler import Scheduler, SchedulerConfig
from optkit.runtime.sequence import FinishReason, SamplingParams, Sequence

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_MEMORY_FRACTION = 0.25  # of physical memory, when --kv-cache-blocks is not given


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_blocks: int | None = None  # default: max_num_seqs full-length sequences, capped by memory
    block_size: int = 16
    dtype: str = "float32"
    device: str = "cpu"
    enable_prefix_caching: bool = True
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise OptkitError(f"--{name.replace('_', '-')} must be at least 1")
        if self.dtype not in DTYPES:
            raise OptkitError(f"unknown --dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens since the previous output
    text: str  # new text since the previous output; stop strings never appear
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_prompt_tokens: int
    num_prompt_tokens_computed: int
    num_prefix_cache_hit_tokens: int
    num_generation_tokens: int
    num_preemptions: int


class QueueFull(Exception):
    """More requests are waiting than the engine accepts (`max_waiting`)."""


class _Request:
    """The engine's per-request state beyond the scheduler's: text and output bookkeeping."""

    def __init__(self, seq: Sequence, detokenizer: Detokenizer):
        self.seq = seq
        self.detokenizer = detokenizer
        self.num_reported = 0  # output tokens already returned
        self.logprobs: list[TokenLogprobs] = []


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        import torch

        from optkit.modeldir import load_tokenizer
        from optkit.models.loader import load_runtime_model
        from optkit.runtime.model_runner import ModelRunner, kv_bytes_per_block

        self.config = config = config or EngineConfig()
        self.model = load_runtime_model(model, dtype=getattr(torch, config.dtype), device=config.device)
        self.tokenizer = load_tokenizer(model)
        model_config = self.model.config
        limit = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise OptkitError(f"--max-model-len {config.max_model_len} exceeds the model's context of {limit} tokens")
        self.max_model_len = config.max_model_len or limit
        num_blocks = config.kv_cache_blocks or _default_num_blocks(
            config, self.max_model_len, kv_bytes_per_block(self.model, config.block_size)
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                eos_token_ids=tuple(model_config.eos_token_ids),
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(self.model, num_blocks, config.block_size)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the limits when the request can never run."""
        vocab_size = self.model.config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab_size})")
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}: together "
                f"{num_prompt_tokens + params.max_tokens}, over the context limit of {self.max_model_len} tokens"
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> Sequence:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        seq = Sequence(prompt_token_ids, params, request_id)
        self.scheduler.add(seq)
        self.requests[request_id] = _Request(seq, Detokenizer(self.tokenizer, params.stop))
        self.num_prompt_tokens += len(prompt_token_ids)
        return seq

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request_id)
            self.sampler.forget(request.seq.seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One model step; an output for every request that got tokens or finished."""
        schedule = self.scheduler.schedule()
        if not schedule.scheduled:
            return []
        logits, seqs = self.runner.run(schedule.scheduled)
        sampled = self.sampler(logits, seqs)
        for seq, logprobs in zip(seqs, sampled.logprobs, strict=True):
            if logprobs is not None:
                self.requests[seq.request_id].logprobs.append(logprobs)
        finished = self.scheduler.update(schedule, {s.seq_id: t for s, t in zip(seqs, sampled.token_ids, strict=True)})
        self.num_generation_tokens += len(seqs)
        outputs = [self._output(seq) for seq in seqs if not seq.is_finished]
        outputs += [self._output(seq) for seq in finished]
        return [o for o in outputs if o is not None]

    def _output(self, seq: Sequence) -> RequestOutput | None:
        request = self.requests.get(seq.request_id)
        if request is None:
            return None
        text = request.detokenizer.update(seq.output_token_ids, seq.is_finished)
        if request.detokenizer.stopped and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP)
        new_tokens = seq.output_token_ids[request.num_reported :]
        request.num_reported = seq.num_output_tokens
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, request.logprobs = request.logprobs, []
        if seq.is_finished:
            del self.requests[seq.request_id]
            self.sampler.forget(seq.seq_id)
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=new_tokens,
            text=text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
        )

    def generate(
        self,
        prompts: Iterable[list[int]],
        params: SamplingParams | list[SamplingParams],
        on_output: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[list[int]]:
        """Offline: runs every prompt to completion in continuous batches; their output token ids.
        `on_output(i, output)` sees each output of prompt i as it is produced."""
        prompts = list(prompts)
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        index = {f"offline-{id(self)}-{i}": i for i in range(len(prompts))}
        for request_id, prompt, p in zip(index, prompts, per_prompt, strict=True):
            self.add_request(prompt, p, request_id)
        results: list[list[int]] = [[] for _ in prompts]
        while self.has_unfinished():
            for output in self.step():
                i = index[output.request_id]
                results[i] += output.token_ids
                if on_output is not None:
                    on_output(i, output)
        return results

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self.block_manager.usage,
            num_kv_blocks=self.block_manager.num_blocks,
            num_prompt_tokens=self.num_prompt_tokens,
            num_prompt_tokens_computed=scheduler.num_prompt_tokens_computed,
            num_prefix_cache_hit_tokens=scheduler.num_prefix_cache_hit_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=scheduler.num_preemptions,
        )


def _default_num_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int) -> int:
    """Enough blocks for max_num_seqs sequences of full length, within a share of memory."""
    wanted = config.max_num_seqs * -(-max_model_len // config.block_size)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return wanted
    return max(1, min(wanted, int(memory * KV_CACHE_MEMORY_FRACTION) // bytes_per_block))
