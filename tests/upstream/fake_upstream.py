"""A fake OpenAI-compatible upstream (what vLLM's server answers, from aiohttp in a thread of the
test process) whose faults a test chooses: `mode` is ok, error500, malformed, malformed_late,
hang or slow. It records the headers of each request and whether a stream's client went away."""

import asyncio
import json
import threading
from contextlib import contextmanager

from aiohttp import web

from tests.serve_process import free_port

TOKENS = [[11, 12], [13], [14, 15]]  # the token ids of each streamed chunk


class FakeUpstream:
    def __init__(self, root: str):
        self.root, self.mode, self.owned_by = root, "ok", "vllm"
        self.headers: list[dict] = []
        self.bodies: list[dict] = []
        self.went_away = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def models(self, request):
        card = {
            "id": "served-small",
            "object": "model",
            "owned_by": self.owned_by,
            "root": self.root,
            "max_model_len": 128,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request):
        self.headers.append(dict(request.headers))
        self.bodies.append(await request.json())
        if self.mode == "error500":
            return web.json_response({"error": {"message": "secret /path/in/trace"}}, status=500)
        if self.mode == "hang":
            await asyncio.sleep(30)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "malformed":
            await response.write(b"data: {not json\n\n")
            return response
        try:
            for i, ids in enumerate(TOKENS):
                if self.mode == "malformed_late" and i == 1:
                    await response.write(b"data: [1, 2\n\n")
                    return response
                finish = "length" if i == len(TOKENS) - 1 else None
                choice = {"index": 0, "text": "".join(f"<{t}>" for t in ids), "token_ids": ids, "finish_reason": finish}
                await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                if self.mode == "slow":
                    await asyncio.sleep(0.5)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.went_away.set()
            raise
        return response


@contextmanager
def fake_upstream(root: str):
    upstream = FakeUpstream(root)
    app = web.Application()
    app.router.add_get("/v1/models", upstream.models)
    app.router.add_post("/v1/completions", upstream.completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", upstream.port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield upstream
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
