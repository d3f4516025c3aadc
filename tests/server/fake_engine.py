"""A stand-in for `AsyncEngine` (docs/runtime.md, "The engine's front") for in-process server tests.

It has a real tokenizer, yields one deterministic token per output after a small sleep, honours
max_tokens, stop strings and logprobs, and records what it was asked: the prompts and params it
received, the requests it finished and those whose consumer went away (`aborted`).
"""

import asyncio
from dataclasses import dataclass

from optkit.runtime.engine import EngineStats, QueueFull, RequestOutput
from optkit.runtime.sequence import SamplingParams

WORDS = " the cat sat on a mat and looked at every bird"


@dataclass
class FakeTokenLogprobs:  # the fields of runtime/sampler.py's TokenLogprobs
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class FakeEngine:
    def __init__(self, tokenizer, model_name: str = "small", max_model_len: int = 128, step_s: float = 0.002):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.step_s = step_s  # sleep before each output
        self.first_delay_s = 0.0  # extra sleep before the first output (time "in the queue")
        self.queue_full = False  # generate raises QueueFull
        self.fail_after: int | None = None  # raise RuntimeError after this many outputs
        self.words = tokenizer.encode(WORDS)
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.running: set[str] = set()
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.shut_down = False

    def expected_ids(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """The tokens this engine generates for a prompt: deterministic, whatever the params."""
        return [self.words[(sum(prompt_ids) + i) % len(self.words)] for i in range(max_tokens)]

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        if self.queue_full:
            raise QueueFull("1024 requests are already waiting")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"too long for the context limit of {self.max_model_len} tokens")
        self.requests[request_id] = (list(prompt_token_ids), params)
        self.running.add(request_id)
        self.num_prompt_tokens += len(prompt_token_ids)
        finished = False
        try:
            await asyncio.sleep(self.first_delay_s)
            text = ""
            for i, token in enumerate(self.expected_ids(prompt_token_ids, params.max_tokens)):
                await asyncio.sleep(self.step_s)
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("the engine failed: injected")
                self.num_generation_tokens += 1
                piece = self.tokenizer.decode([token])
                at = min((j for s in params.stop if (j := (text + piece).find(s)) != -1), default=-1)
                finished = at != -1 or i == params.max_tokens - 1
                reason = ("stop" if at != -1 else "length") if finished else None
                delta = (text + piece)[len(text) : at] if at != -1 else piece
                text += piece
                logprobs = None
                if params.logprobs is not None:
                    logprobs = [
                        FakeTokenLogprobs(token, -0.5, [(token, -0.5), (self.words[0], -1.5)][: params.logprobs])
                    ]
                if finished:
                    self.finished.append(request_id)
                yield RequestOutput(
                    request_id=request_id,
                    token_ids=[token],
                    text=delta,
                    finished=finished,
                    finish_reason=reason,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=i + 1,
                    num_cached_tokens=0,
                    logprobs=logprobs,
                )
                if finished:
                    return
        finally:  # synchronous, as the real engine's: it must run even inside a cancelled scope
            self.running.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    is_running = True

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=0,
            kv_cache_usage=len(self.running) / 8,
            num_kv_blocks=8,
            num_prompt_tokens=self.num_prompt_tokens,
            num_prompt_tokens_computed=self.num_prompt_tokens,
            num_prefix_cache_hit_tokens=3,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=0,
        )

    def shutdown(self) -> None:
        self.shut_down = True
