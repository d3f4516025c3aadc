"""The FastAPI app: OpenAI's API over an `AsyncEngine` (docs/runtime.md, "The engine's front").

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /metrics. With an API key every /v1 route needs `Authorization: Bearer KEY`;
/health and /metrics stay open (they show load, never prompts or outputs).

The engine's first output is awaited before a response starts, so a full queue (503 with
Retry-After) and a prompt that cannot fit (400) keep their status codes for streams too.
A client that goes away closes the engine's stream, which aborts the request and frees its KV
blocks: while waiting for the first output or a whole (non-streamed) response through
`until_disconnected`, mid-stream when Starlette cancels the response on `http.disconnect`
(`SSEResponse` then closes the event generator, and each generator closes what it iterates).
"""

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from optkit.runtime.engine import QueueFull
from optkit.runtime.sequence import SamplingParams
from optkit.server import responses
from optkit.server.chat import chat_prompt_ids
from optkit.server.errors import APIError, ClientDisconnected, error_response, install_error_handlers
from optkit.server.metrics import ServerMetrics
from optkit.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

DEFAULT_MAX_TOKENS = 16  # completions; chat defaults to the rest of the context, as OpenAI does
RETRY_AFTER_S = 1

T = TypeVar("T")
router = APIRouter()


@dataclass
class Served:
    engine: object  # AsyncEngine, or anything with its interface
    metrics: ServerMetrics
    created: int


def build_app(engine, api_key: str | None, *, shutdown_engine: bool = False) -> FastAPI:
    """The app serving `engine`; with `shutdown_engine`, the app's shutdown stops the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="optkit", lifespan=lifespan)
    app.state.served = Served(engine, ServerMetrics(engine), int(time.time()))
    install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.include_router(router)
    return app


class BearerAuth:
    """`Authorization: Bearer KEY` on /v1 routes. Plain ASGI: Starlette's BaseHTTPMiddleware
    would get in the way of streamed responses."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization")
            scheme, _, token = (header or b"").partition(b" ")
            if header is None or scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                message = "incorrect API key" if header else "missing API key: send Authorization: Bearer YOUR_KEY"
                response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SSEResponse(StreamingResponse):
    """Server-sent events that close their generators however the stream ends (finished,
    cancelled on disconnect, a failed send), without waiting for the garbage collector: the
    events generator, then the engine's stream (in case the events never started)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.outputs = outputs

    async def stream_response(self, send) -> None:
        async with aclosing(self.outputs), aclosing(self.body_iterator):
            await super().stream_response(send)


def _served(request: Request) -> Served:
    return request.app.state.served


@router.get("/health")
async def health(request: Request) -> Response:
    if not _served(request).engine.is_running:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _served(request).metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(_served(request))])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> ModelCard:
    served = _served(request)
    _check_model(served, model_id)
    return _model_card(served)


def _model_card(served: Served) -> ModelCard:
    engine = served.engine
    return ModelCard(id=engine.model_name, created=served.created, max_model_len=engine.max_model_len)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    served = _served(request)
    _check_model(served, body.model)
    tokenizer = served.engine.tokenizer
    prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    _check_token_ids(prompt_ids, tokenizer)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = _sampling_params(body, max_tokens, body.logprobs)
    reply = _reply(served, "cmpl", body, want_logprobs=body.logprobs is not None)
    return await _respond(request, served, prompt_ids, params, reply, body.stream, "completion")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    served = _served(request)
    _check_model(served, body.model)
    engine = served.engine
    try:
        prompt_ids = chat_prompt_ids(engine.tokenizer, body.messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = engine.max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise APIError(
                400,
                f"the messages take {len(prompt_ids)} tokens, which leaves no room to reply "
                f"within the context limit of {engine.max_model_len} tokens: shorten them",
                param="messages",
            )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(body, max_tokens, logprobs)
    reply = _reply(served, "chatcmpl", body, want_logprobs=body.logprobs)
    return await _respond(request, served, prompt_ids, params, reply, body.stream, "chat")


def _check_model(served: Served, model: str | None) -> None:
    name = served.engine.model_name
    if model is not None and model != name:
        message = f"the model {model!r} does not exist: this server serves {name!r}"
        raise APIError(404, message, param="model", code="model_not_found")


def _check_token_ids(prompt_ids: list[int], tokenizer) -> None:
    vocab_size = len(tokenizer)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt: token id {bad} is not in the vocabulary (0..{vocab_size - 1})", param="prompt")


def _sampling_params(body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _reply(served: Served, prefix: str, body, want_logprobs: bool) -> responses.Reply:
    engine = served.engine
    return responses.Reply(
        id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=engine.model_name,
        tokenizer=engine.tokenizer,
        logprobs=want_logprobs,
        include_usage=body.include_usage,
    )


async def _respond(
    request: Request,
    served: Served,
    prompt_ids: list[int],
    params: SamplingParams,
    reply,
    stream: bool | None,
    kind: str,
) -> Response:
    limit = served.engine.max_model_len
    if len(prompt_ids) + params.max_tokens > limit:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: together "
            f"{len(prompt_ids) + params.max_tokens}, over the context limit of {limit} tokens; "
            "shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    outputs = served.metrics.track(served.engine.generate(prompt_ids, params, reply.id))
    try:
        first = await until_disconnected(request, _first_output(outputs))
        if stream:
            events = responses.completion_events if kind == "completion" else responses.chat_events
            return SSEResponse(events(reply, first, outputs), outputs)
        done = await until_disconnected(request, responses.collect(first, outputs))
    except BaseException:
        await outputs.aclose()  # usually closed already; never left for the garbage collector
        raise
    body = responses.completion_response(reply, done) if kind == "completion" else responses.chat_response(reply, done)
    return Response(body.model_dump_json(), media_type="application/json")


async def _first_output(outputs: AsyncIterator):
    try:
        return await anext(outputs)
    except QueueFull as e:
        message, retry = f"the server is busy ({e}): retry later", {"Retry-After": str(RETRY_AFTER_S)}
        raise APIError(503, message, type="server_error", code="overloaded", headers=retry) from None
    except ValueError as e:  # the engine's own check of the request (e.g. the context limit)
        raise APIError(400, str(e)) from None


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (which
    closes the engine's stream it awaits) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
