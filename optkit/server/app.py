"""The FastAPI app: OpenAI's API over an `AsyncEngine` (docs/runtime.md, "The engine's front").

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /metrics, and optkit's own under /v1/optkit (server/optkit_routes.py); FastAPI's
/docs, /redoc and /openapi.json only when asked (`docs`, `optkit serve --docs`). In front of them
(guards.py): the Host check, the API key (every route but /health), the body's size and time limits.

Prompts are tokenized in a small thread pool, never on the event loop, and chat templates rendered
from there in worker processes that a time limit can stop (server/template_render.py); a list of
token ids longer than every served context is refused before any work per token.

The app serves a `Router` (routing/router.py): one engine, or several models with a routing
policy, shadow scoring and fallback. It picks each request's engine; the answer names it in the
`x-optkit-model` header (and why, in `x-optkit-route`).

The engine's first output is awaited before a response starts, so a full queue (503 with
Retry-After) and a prompt that cannot fit (400) keep their status codes for streams too.
A client that goes away closes the engine's stream, which aborts the request and frees its KV
blocks: while waiting for the first output or a whole (non-streamed) response through
`until_disconnected`, mid-stream when Starlette cancels the response on `http.disconnect`
(`SSEResponse` then closes the event generator, and each generator closes what it iterates).
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from optkit.routing.router import Prompt, Route, Router
from optkit.runtime.engine import QueueFull
from optkit.runtime.sequence import SamplingParams
from optkit.server import optkit_routes, responses
from optkit.server.errors import APIError, ClientDisconnected, install_error_handlers
from optkit.server.guards import (
    RENDERED_CHARS_PER_BODY_BYTE,
    BearerAuth,
    BodyLimit,
    HostCheck,
    Limits,
    default_max_request_bytes,
)
from optkit.server.metrics import ServerMetrics
from optkit.server.prompts import chat_prompt, completion_prompt, refuse_length
from optkit.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from optkit.server.routing_metrics import RouterCollector
from optkit.server.template_render import TemplateRenderer

DEFAULT_MAX_TOKENS = 16  # completions; chat defaults to the rest of the context, as OpenAI does
RETRY_AFTER_S = 1
TOKENIZER_THREADS = 4  # prompts tokenized at once; more wait their turn

T = TypeVar("T")
api = APIRouter()


@dataclass
class Served:
    router: Router
    metrics: ServerMetrics
    created: int
    tokenizer_pool: ThreadPoolExecutor
    templates: TemplateRenderer

    @property
    def engine(self):
        """The default model's engine."""
        return self.router.engines[self.router.default]


def build_app(
    engine, api_key: str | None, *, shutdown_engine: bool = False, limits: Limits | None = None, docs: bool = False
) -> FastAPI:
    """The app serving `engine` (an AsyncEngine, or anything with its interface) or a `Router`;
    with `shutdown_engine`, the app's shutdown stops the engines; with `docs`, FastAPI's API pages
    (behind the key when there is one)."""
    models = engine if isinstance(engine, Router) else Router.single(engine)
    limits = limits or Limits()
    pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="optkit-tokenize")
    max_bytes = limits.max_request_bytes or default_max_request_bytes(_longest_context(models))
    templates = TemplateRenderer(limits.chat_template_timeout_s, RENDERED_CHARS_PER_BODY_BYTE * max_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.shutdown(wait=False, cancel_futures=True)
        templates.close()
        if shutdown_engine:
            models.shutdown()

    pages = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="optkit", lifespan=lifespan, **pages)
    metrics = ServerMetrics(models)  # the engines' stats, added up
    metrics.registry.register(RouterCollector(models))
    app.state.served = Served(models, metrics, int(time.time()), pool, templates)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_bytes, timeout_s=limits.body_timeout_s)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    elif limits.hosts is not None:
        app.add_middleware(HostCheck, hosts=limits.hosts)
    app.include_router(api)
    app.include_router(optkit_routes.api)
    return app


class SSEResponse(StreamingResponse):
    """Server-sent events that close their generators however the stream ends (finished,
    cancelled on disconnect, a failed send), without waiting for the garbage collector: the
    events generator, then the engine's stream (in case the events never started)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator, headers: dict[str, str] | None = None):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.outputs = outputs

    async def stream_response(self, send) -> None:
        async with aclosing(self.outputs), aclosing(self.body_iterator):
            await super().stream_response(send)


def _longest_context(models: Router) -> int:
    return max(e.max_model_len for e in models.engines.values())


def _served(request: Request) -> Served:
    return request.app.state.served


@api.get("/health")
async def health(request: Request) -> Response:
    if not _served(request).router.is_running:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@api.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _served(request).metrics.render()
    return Response(body, media_type=content_type)


@api.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    served = _served(request)
    return ModelList(data=[_model_card(served, name) for name in served.router.names])


@api.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> ModelCard:
    served = _served(request)
    served.router.check_model(model_id)
    return _model_card(served, model_id)


def _model_card(served: Served, name: str) -> ModelCard:
    engine = served.router.engines[name]
    return ModelCard(id=name, created=served.created, max_model_len=engine.max_model_len)


@api.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    served = _served(request)
    prompt = completion_prompt(body.prompt, _longest_context(served.router))
    route = await _route(served, body.model, request, prompt, "prompt")
    _check_token_ids(route.prompt_ids, route.engine.tokenizer)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = _sampling_params(body, max_tokens, body.logprobs)
    reply = _reply(route, "cmpl", body, want_logprobs=body.logprobs is not None)
    return await _respond(request, served, route, params, reply, body.stream, "completion")


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    served = _served(request)
    prompt = chat_prompt(body.messages, _longest_context(served.router), served.templates)
    route = await _route(served, body.model, request, prompt, "messages")
    engine, prompt_ids = route.engine, route.prompt_ids
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
    reply = _reply(route, "chatcmpl", body, want_logprobs=body.logprobs)
    return await _respond(request, served, route, params, reply, body.stream, "chat")


async def _route(served: Served, model: str | None, request: Request, prompt: Prompt, param: str) -> Route:
    """The route, the prompt tokenized first in the pool for every tokenizer routing may use; a
    prompt no served context can hold is refused before routing looks at its tokens."""
    tokenizers = served.router.tokenizers_for(model)
    await asyncio.get_running_loop().run_in_executor(served.tokenizer_pool, prompt.prepare, tokenizers)
    longest = _longest_context(served.router)
    num_tokens = min(len(prompt.ids_for(t)) for t in tokenizers)
    if num_tokens >= longest:
        refuse_length(num_tokens, longest, param)
    return served.router.route(model, request.headers, prompt)


def _check_token_ids(prompt_ids: list[int], tokenizer) -> None:
    vocab_size = len(tokenizer)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt: token id {bad} is not in the vocabulary (0..{vocab_size - 1})", param="prompt")


def _sampling_params(body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]  # the engine's messages start with the parameter's name
        raise APIError(400, str(e), param=param if param in type(body).model_fields else None) from None


def _reply(route: Route, prefix: str, body, want_logprobs: bool) -> responses.Reply:
    return responses.Reply(
        id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=route.name,
        tokenizer=route.engine.tokenizer,
        logprobs=want_logprobs,
        include_usage=body.include_usage,
    )


async def _respond(
    request: Request,
    served: Served,
    route: Route,
    params: SamplingParams,
    reply,
    stream: bool | None,
    kind: str,
) -> Response:
    prompt_ids = route.prompt_ids
    limit = route.engine.max_model_len
    if len(prompt_ids) + params.max_tokens > limit:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: together "
            f"{len(prompt_ids) + params.max_tokens}, over the context limit of {limit} tokens; "
            "shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    generated = route.engine.generate(prompt_ids, params, reply.id)
    outputs = served.metrics.track(served.router.track(route, generated, reply.id))
    headers = {"x-optkit-model": route.name, "x-optkit-route": route.reason}
    try:
        first = await until_disconnected(request, _first_output(outputs))
        if stream:
            events = responses.completion_events if kind == "completion" else responses.chat_events
            return SSEResponse(events(reply, first, outputs), outputs, headers)
        done = await until_disconnected(request, responses.collect(first, outputs))
    except BaseException:
        await outputs.aclose()  # usually closed already; never left for the garbage collector
        raise
    body = responses.completion_response(reply, done) if kind == "completion" else responses.chat_response(reply, done)
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


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
