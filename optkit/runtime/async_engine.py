"""`AsyncEngine`: an `LLMEngine` on its own thread, with a stream of outputs per request for
asyncio callers, so tokenisation and HTTP never stall the model. Requests and aborts reach the
engine thread through a thread-safe inbox; outputs come back through `call_soon_threadsafe`
onto each request's asyncio queue."""

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from optkit.runtime.engine import EngineConfig, EngineStats, LLMEngine, QueueFull, RequestOutput
from optkit.runtime.sequence import SamplingParams


class AsyncEngine:
    """An `LLMEngine` on its own thread; `generate` streams a request's outputs to asyncio."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self._inbox: queue.Queue = queue.Queue()  # ("add", ...) / ("abort", id) / ("stop",), from any thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="optkit-engine", daemon=True)
        self._running = True
        self._thread.start()

    @classmethod
    def start(cls, model: str | Path, config: EngineConfig, model_name: str | None = None) -> "AsyncEngine":
        return cls(LLMEngine(model, config), model_name or Path(str(model)).name)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        self.engine.check_request(prompt_token_ids, params)
        if len(self._streams) - self.engine.scheduler.num_running >= self.engine.config.max_waiting:
            raise QueueFull(f"{self.engine.config.max_waiting} requests are already waiting")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", prompt_token_ids, params, request_id))
        finished = False
        try:
            while not finished:
                output = await stream.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away: free the request's KV blocks
                self._inbox.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def is_running(self) -> bool:
        """False once the engine thread has stopped (shut down or died): the server is unhealthy."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._running = False
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        engine = self.engine
        while self._running:
            self._drain_inbox(block=not engine.has_unfinished())
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # a model failure ends every request in flight, not the server
                self._fail_all(error)
                continue
            for output in outputs:
                self._deliver(output.request_id, output)

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                self._handle(message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, prompt, params, request_id = message
            if request_id not in self._streams:  # aborted before it was added
                return
            try:
                self.engine.add_request(prompt, params, request_id)
            except ValueError as error:
                self._deliver(request_id, error)
        elif kind == "abort":
            self.engine.abort(message[1])

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            with contextlib.suppress(RuntimeError):  # the caller's event loop has closed
                loop.call_soon_threadsafe(stream.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        failure = RuntimeError(f"the engine failed: {error}")
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, failure)
