"""The engine on its own thread behind asyncio: concurrent streams, aborts on disconnect, a full queue."""

import asyncio
import time

import pytest

from optkit.runtime.async_engine import AsyncEngine
from optkit.runtime.engine import EngineConfig, QueueFull
from optkit.runtime.sequence import SamplingParams


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def engine(draft_dir):
    engine = AsyncEngine.start(draft_dir, EngineConfig(max_num_seqs=2, max_waiting=1))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    tokens = []
    async for output in engine.generate(prompt, params, request_id):
        tokens += output.token_ids
    return tokens


def test_concurrent_streams_match_the_offline_engine(draft_dir):
    engine = AsyncEngine.start(draft_dir, EngineConfig(max_num_seqs=2))
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    async def main():
        return await asyncio.gather(*(collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))

    streamed = asyncio.run(main())
    engine.shutdown()
    assert streamed == engine.engine.generate(prompts, params)


def test_a_consumer_that_stops_aborts_its_request_and_frees_its_blocks(engine):
    async def main():
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), "gone")
        async for _ in stream:
            assert engine.stats().kv_cache_usage > 0
            break
        await stream.aclose()

    asyncio.run(main())
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0)


def test_a_full_queue_refuses_before_any_output(engine):
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main():
        running = [engine.generate([5, 6], long, f"run{i}") for i in range(2)]
        for stream in running:
            await anext(stream)  # both admitted: max_num_seqs is 2
        waiting = engine.generate([5, 6], long, "waits")
        task = asyncio.ensure_future(anext(waiting))
        await asyncio.sleep(0.05)  # registered and queued behind the two running requests
        with pytest.raises(QueueFull):
            await anext(engine.generate([5, 6], long, "refused"))
        task.cancel()
        for stream in running:
            await stream.aclose()

    asyncio.run(main())
    assert wait_until(lambda: engine.stats().kv_cache_usage == 0)
