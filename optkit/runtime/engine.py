"""The engine: scheduler -> decoding.propose -> model runner -> decoding.sample -> scheduler, one step at a time.

`LLMEngine` is the synchronous core (offline batches, `optkit generate`); `async_engine.AsyncEngine`
runs it on its own thread for the server (docs/runtime.md, "The engine's front"). How logits become
tokens is the engine's one `decoding.Decoding`: plain, or speculative (proposals before the model
runs, verified after it).
"""

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from optkit.errors import OptkitError
from optkit.runtime import compile_cache
from optkit.runtime.block_manager import BlockManager
from optkit.runtime.decoding import make_decoding
from optkit.runtime.detokenizer import Detokenizer
from optkit.runtime.engine_args import EngineConfig
from optkit.runtime.kv_groups import KVCacheGroups
from optkit.runtime.multi_step import DecodeStepTokens
from optkit.runtime.sampler import Sampler, TokenLogprobs
from optkit.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from optkit.runtime.sequence import SamplingParams, Sequence

KV_CACHE_MEMORY_FRACTION = 0.25  # of physical memory, when --kv-cache-blocks is not given


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
    kv_cache_bytes_per_token: float = 0.0  # K and V of one token in every layer (8-bit: block scales included)
    # speculative decoding (zero when off); a step is one sequence's decode step with proposals reserved
    spec_proposer: str | None = None  # "ngram", "draft" or "eagle"
    num_spec_steps: int = 0
    num_spec_draft_tokens: int = 0  # tokens proposed
    num_spec_accepted_tokens: int = 0  # ... and accepted by the target
    spec_acceptance_rate: float = 0.0  # accepted / proposed
    spec_mean_accepted_tokens: float = 0.0  # accepted per step (each step adds one more of the target's)


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

        from optkit.devices import set_cpu_threads
        from optkit.modeldir import load_tokenizer, resolve_model_dir
        from optkit.models.loader import load_runtime_model
        from optkit.runtime.model_runner import ModelRunner, kv_bytes_per_block

        self.config = config = config or EngineConfig()
        set_cpu_threads(config.threads)
        self.model = load_runtime_model(model, dtype=getattr(torch, config.dtype), device=config.device)
        self.tokenizer = load_tokenizer(model)
        model_config = self.model.config
        limit = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise OptkitError(f"--max-model-len {config.max_model_len} exceeds the model's context of {limit} tokens")
        self.max_model_len = config.max_model_len or limit
        self.model.set_context_limit(self.max_model_len)  # LongRoPE's factors follow it (docs/runtime.md)
        full_block = kv_bytes_per_block(self.model, config.block_size)  # at the model's dtype
        block = kv_bytes_per_block(self.model, config.block_size, config.kv_cache_dtype)  # 8-bit scales included
        if config.kv_cache_blocks:  # the data of that many blocks at the model's dtype (8-bit: scales on top)
            data = kv_bytes_per_block(self.model, config.block_size, config.kv_cache_dtype, scales=False)
            num_blocks = max(1, config.kv_cache_blocks * full_block // data)
        else:
            num_blocks = _default_num_blocks(config, self.max_model_len, block)
        # KV cache groups: one table per kind of layer; the sliding ones release the blocks that leave
        # their window (Mistral: every layer, Gemma: the local ones; docs/runtime.md)
        self.kv_groups = KVCacheGroups.for_windows(
            [model_config.window(i) for i in range(model_config.num_hidden_layers)]
        )
        num_full_blocks, num_blocks = num_blocks, self.kv_groups.num_block_ids(num_blocks)  # same memory
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, group_windows=self.kv_groups.windows
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                eos_token_ids=tuple(model_config.eos_token_ids),
                num_speculative_tokens=config.num_speculative_tokens if config.speculative else 0,
                num_scheduler_steps=config.scheduler_steps(),
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.kv_cache_dtype, self.kv_groups)
        # this machine's warm-up of the model (optkit compile), then the decode graphs (CUDA)
        warmed = compile_cache.lookup(resolve_model_dir(model), config.device, config.compile_dir)
        torch_compile = config.torch_compile or bool(warmed and warmed.record.get("torch_compile"))
        self.cuda_graphs_note = self.runner.capture_decode_graphs(
            config.max_num_seqs, self.max_model_len, config.enforce_eager, torch_compile
        )
        if warmed is not None:
            self.cuda_graphs_note += f"; {warmed.note}"
        self.sampler = Sampler()
        self.decoding = make_decoding(config, self.model, self.tokenizer, num_full_blocks, resolve_model_dir(model))
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
            self.decoding.release(request.seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One model step; an output for every request that got tokens or finished."""
        schedule = self.scheduler.schedule()
        for seq in schedule.preempted:
            self.decoding.release(seq)
        if not schedule.scheduled:
            return []
        if schedule.num_steps > 1:  # multi-step decoding (runtime/multi_step.py)
            seqs = [item.seq for item in schedule.scheduled]
            chooser = DecodeStepTokens(seqs, self.sampler, self.scheduler.config.eos_token_ids)
            self.runner.run_decode_steps(schedule.scheduled, schedule.num_steps, chooser)
            tokens, logprobs = chooser.sampled()
        else:
            tokens, logprobs, seqs = self._run_step(schedule)
        before = [seq.num_output_tokens for seq in seqs]
        finished = self.scheduler.update(schedule, tokens, self._stop_strings(seqs))
        for seq, num_before in zip(seqs, before, strict=True):
            appended = seq.num_output_tokens - num_before  # the tokens past a stop were not appended
            self.num_generation_tokens += appended
            if seq.seq_id in logprobs:
                self.requests[seq.request_id].logprobs += logprobs[seq.seq_id][:appended]
        outputs = [self._output(seq) for seq in seqs if not seq.is_finished]
        outputs += [self._output(seq) for seq in finished]
        return [o for o in outputs if o is not None]

    def _run_step(self, schedule: SchedulerOutput) -> tuple[dict, dict, list[Sequence]]:
        """One model step and its sampling: the tokens and logprobs of each sequence that samples."""
        self.decoding.propose(schedule.scheduled)
        hidden = None  # every token's hidden state, for a proposer that reads the target's features
        if self.decoding.needs_hidden:
            logits, seqs, hidden = self.runner.run_with_hidden(schedule.scheduled, self.decoding.feature_layers)
        else:
            logits, seqs = self.runner.run(schedule.scheduled)
        tokens, logprobs = self.decoding.sample(logits, seqs, schedule.scheduled, self.sampler)
        if hidden is not None:
            self.decoding.observe(schedule.scheduled, tokens, hidden)
        return tokens, logprobs, seqs

    def _stop_strings(self, seqs: list[Sequence]) -> dict[int, Detokenizer]:
        """The detokenizers that watch each new token of `seqs` for a stop string (runtime/stopping.py)."""
        requests = (self.requests.get(seq.request_id) for seq in seqs)
        return {r.seq.seq_id: r.detokenizer for r in requests if r is not None and r.detokenizer.stop}

    def _output(self, seq: Sequence) -> RequestOutput | None:
        request = self.requests.get(seq.request_id)
        if request is None:
            return None
        if not request.detokenizer.stop:  # no text can stop it, so the step's tokens were not watched
            request.detokenizer.watch(seq.output_token_ids, seq.is_finished)
        text = request.detokenizer.take()
        new_tokens = seq.output_token_ids[request.num_reported :]
        request.num_reported = seq.num_output_tokens
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, request.logprobs = request.logprobs[: len(new_tokens)], []
        if seq.is_finished:
            del self.requests[seq.request_id]
            self.sampler.forget(seq.seq_id)
            self.decoding.release(seq)
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
            kv_cache_bytes_per_token=self.runner.kv_bytes_per_token,
            **self.decoding.stats.engine_fields(),
        )


def _default_num_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int) -> int:
    """Enough blocks for max_num_seqs sequences of full length, within a share of memory."""
    wanted = config.max_num_seqs * -(-max_model_len // config.block_size)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return wanted
    return max(1, min(wanted, int(memory * KV_CACHE_MEMORY_FRACTION) // bytes_per_block))
