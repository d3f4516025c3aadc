"""An OpenAI-compatible server (vLLM, or another optkit) as an engine the router can use beside
in-process ones: `optkit serve --backend NAME=URL` (docs/serving.md, "Upstreams").

It has `AsyncEngine`'s interface (generate, tokenizer, max_model_len, stats, is_running, shutdown).
The prompt is tokenized here, as for every engine (chat templates render in optkit), and sent as
token ids to the upstream's /v1/completions, streamed. A client that goes away closes the stream,
which closes the upstream connection (vLLM then aborts the request). Every upstream failure is an
`UpstreamError` with the status the client gets (502, or 504 past a timeout) and a message that
names the upstream, never its body or a traceback; at most `max_concurrency` requests are in
flight to one upstream, and past `max_waiting` more waiting ones a request is `QueueFull` (503).
The client's Authorization never reaches the upstream: only the upstream's own key does.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from optkit.runtime.engine import EngineStats, QueueFull, RequestOutput
from optkit.runtime.sequence import SamplingParams

MAX_LINE_BYTES = 1 << 20  # one server-sent event line; longer is a malformed stream


class UpstreamError(Exception):
    """The upstream failed a request: `status` is what the client gets (502 or 504)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class UpstreamLimits:
    max_concurrency: int = 16  # requests in flight to this upstream
    max_waiting: int = 64  # requests waiting for a slot; more are refused (503)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0  # the first token, and between two chunks


class UpstreamEngine:
    def __init__(
        self,
        model_name: str,
        url: str,
        tokenizer,
        max_model_len: int,
        *,
        upstream_model: str,
        api_key: str | None = None,
        token_ids: bool = True,
        limits: UpstreamLimits = UpstreamLimits(),
    ):
        self.model_name, self.url, self.tokenizer = model_name, url.rstrip("/"), tokenizer
        self.max_model_len, self.upstream_model = max_model_len, upstream_model
        self.api_key, self.token_ids, self.limits = api_key, token_ids, limits
        self._slots: asyncio.Semaphore | None = None
        self.running = self.waiting = 0
        self.num_prompt_tokens = self.num_generation_tokens = 0

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if params.logprobs is not None:
            raise ValueError(f"logprobs: {self.model_name} is an upstream, whose logprobs optkit does not pass on")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt and max_tokens are over {self.model_name}'s context of {self.max_model_len}")
        self._slots = self._slots or asyncio.Semaphore(self.limits.max_concurrency)
        if self._slots.locked() and self.waiting >= self.limits.max_waiting:
            raise QueueFull(f"{self.limits.max_waiting} requests already wait for upstream {self.model_name}")
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            async for output in self._stream(prompt_token_ids, params, request_id):
                yield output
        finally:
            self.running -= 1
            self._slots.release()

    async def _stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str):
        import aiohttp

        limits = self.limits
        timeout = aiohttp.ClientTimeout(sock_connect=limits.connect_timeout_s, sock_read=limits.read_timeout_s)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = self.request_body(prompt_ids, params)
        where = f"upstream {self.model_name} ({self.url})"
        try:
            async with aiohttp.ClientSession(timeout=timeout, read_bufsize=MAX_LINE_BYTES) as session:
                async with session.post(f"{self.url}/v1/completions", json=body, headers=headers) as response:
                    if 400 <= response.status < 500 and response.status not in (401, 403, 404, 429):
                        raise UpstreamError(response.status, f"{where}: {await _reason(response)}")
                    if response.status != 200:
                        raise UpstreamError(502, f"{where} answered {response.status}")
                    async for output in self._outputs(response.content, len(prompt_ids), request_id, where):
                        yield output
        except (TimeoutError, asyncio.TimeoutError):
            raise UpstreamError(504, f"{where} sent nothing for {limits.read_timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as e:
            raise UpstreamError(502, f"{where} refused the connection ({e.os_error or e})") from None
        except (aiohttp.ClientError, ValueError) as e:
            raise UpstreamError(502, f"{where} broke the stream ({type(e).__name__})") from None

    def request_body(self, prompt_ids: list[int], params: SamplingParams) -> dict:
        """OpenAI's completion request (with vLLM's and optkit's sampling extensions, sent only when
        set, so an upstream that lacks one is asked only what it can do)."""
        body = {
            "model": self.upstream_model,
            "prompt": prompt_ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        optional = {
            "top_p": (params.top_p, 1.0),
            "top_k": (params.top_k, 0),
            "min_p": (params.min_p, 0.0),
            "repetition_penalty": (params.repetition_penalty, 1.0),
            "frequency_penalty": (params.frequency_penalty, 0.0),
            "presence_penalty": (params.presence_penalty, 0.0),
            "seed": (params.seed, None),
            "stop": (list(params.stop), []),
            "stop_token_ids": (sorted(params.stop_token_ids), []),
            "ignore_eos": (params.ignore_eos, False),
        }
        body |= {key: value for key, (value, default) in optional.items() if value != default}
        if self.token_ids:
            body["return_token_ids"] = True  # vLLM's: each chunk carries its token ids
        return body

    async def _outputs(self, content, num_prompt: int, request_id: str, where: str) -> AsyncIterator[RequestOutput]:
        """RequestOutputs from the server-sent events of a streamed completion."""
        generated, finish = 0, None
        while True:
            line = await content.readline()
            if not line:
                raise UpstreamError(502, f"{where} ended the stream before it finished")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if finish is None:
                    raise UpstreamError(502, f"{where} ended the stream before it finished")
                return
            chunk = json.loads(data)
            if not isinstance(chunk, dict) or "error" in chunk:
                raise UpstreamError(502, f"{where} failed mid-stream")
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or ""
                ids = choice.get("token_ids")
                ids = list(ids) if isinstance(ids, list) else (self.tokenizer.encode(text, add_special_tokens=False))
                generated += len(ids)
                finish = choice.get("finish_reason") or finish
                if text or ids or finish:
                    self._count(num_prompt if generated == len(ids) else 0, len(ids))
                    yield RequestOutput(
                        request_id, ids, text, finish is not None, finish, num_prompt, generated, 0, None
                    )

    def _count(self, prompt_tokens: int, new_tokens: int) -> None:
        self.num_prompt_tokens += prompt_tokens
        self.num_generation_tokens += new_tokens

    def stats(self) -> EngineStats:
        """What optkit sees of the upstream: its requests in flight and waiting here, and the tokens
        it answered; the KV cache is the upstream's own (its /metrics)."""
        return EngineStats(
            num_running=self.running,
            num_waiting=self.waiting,
            kv_cache_usage=0.0,
            num_kv_blocks=0,
            num_prompt_tokens=self.num_prompt_tokens,
            num_prompt_tokens_computed=self.num_prompt_tokens,
            num_prefix_cache_hit_tokens=0,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=0,
        )

    @property
    def is_running(self) -> bool:
        return True  # an upstream that is down fails its requests (502), not optkit's health

    def shutdown(self) -> None:
        pass  # each request's connection closes with it


async def _reason(response) -> str:
    """What the upstream found wrong with the request (OpenAI's error body), shortened."""
    try:
        body = json.loads(await response.content.read(4096))
        return str(body["error"]["message"])[:300]
    except Exception:  # any body that is not OpenAI's error
        return f"it refused the request ({response.status})"


def connect(name: str, url: str, tokenizer: str | None, api_key: str | None, limits: UpstreamLimits):
    """The upstream's engine, after asking its /v1/models which model it serves and its context
    (one line naming the upstream when it cannot be reached or answers something else). The
    tokenizer is `tokenizer` (a model directory or reference name), else the directory the
    upstream reports as its model's root when this machine has it (vLLM's `root`)."""
    import urllib.error
    import urllib.request

    from optkit.errors import OptkitError
    from optkit.modeldir import load_tokenizer, resolve_model_dir

    if not url.startswith(("http://", "https://")):
        raise OptkitError(f"--backend {name}={url}: give the upstream's URL, http://HOST:PORT")
    request = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=limits.connect_timeout_s) as response:
            card = json.loads(response.read(1 << 20))["data"][0]
            served, context = str(card["id"]), int(card["max_model_len"])
    except (OSError, ValueError, LookupError, TypeError) as e:
        raise OptkitError(
            f"--backend {name}={url}: its /v1/models did not name a model with max_model_len "
            f"({type(e).__name__}): start the upstream first, or check the URL"
        ) from None
    source = tokenizer or card.get("root")
    if not source:
        raise OptkitError(f"--backend {name}: give its tokenizer with --backend-tokenizer {name}=DIR")
    try:
        loaded = load_tokenizer(resolve_model_dir(source))
    except OptkitError as e:
        raise OptkitError(f"--backend {name}: its tokenizer {source}: {e} (--backend-tokenizer {name}=DIR)") from None
    token_ids = card.get("owned_by") == "vllm"  # vLLM returns token ids with return_token_ids
    return UpstreamEngine(
        name, url, loaded, context, upstream_model=served, api_key=api_key, token_ids=token_ids, limits=limits
    )
