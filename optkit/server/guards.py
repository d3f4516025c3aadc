"""The ASGI layers in front of the app (docs/serving.md, "Limits"), outermost first:

- `HostCheck`: without an API key, the `Host` header must name this server (DNS rebinding: a page
  on another site whose name resolves to 127.0.0.1 sends its own name, and gets a 403).
- `BearerAuth`: with an API key, `Authorization: Bearer KEY` on every route but /health (/v1,
  /metrics, and /docs, /redoc, /openapi.json when `optkit serve --docs` serves them).
- `BodyLimit`: the whole body is read before the app parses anything, at most `max_bytes` of it
  (a Content-Length over the cap, or a chunked body that grows past it: 413) within `timeout_s`
  (408); the app then receives it as one message.

Plain ASGI: Starlette's BaseHTTPMiddleware would get in the way of streamed responses.
"""

import asyncio
import hmac
from dataclasses import dataclass

from optkit.server.errors import error_response

MIB = 1 << 20
MIN_MAX_REQUEST_BYTES = 4 * MIB
# config.json's context length comes with the model (1e9 would mean 32 GB bodies): past this, only
# --max-request-bytes on the command line raises the cap
MAX_DEFAULT_REQUEST_BYTES = 16 * MIB
BYTES_PER_CONTEXT_TOKEN = 32  # room for a context-filling prompt of JSON-escaped characters (6 bytes each)
BODY_TIMEOUT_S = 30.0
CHAT_TEMPLATE_TIMEOUT_S = 2.0  # a model's chat template renders in milliseconds; past this it is stopped
RENDERED_CHARS_PER_BODY_BYTE = 2  # a rendered chat prompt's size, against the body's cap
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


@dataclass(frozen=True)
class Limits:
    """What one client may send. `max_request_bytes` None: `default_max_request_bytes`; `hosts`
    None: any Host header (in-process tests, or a server bound to every interface);
    `chat_template_timeout_s`: the time a model's chat template may take to render one request."""

    max_request_bytes: int | None = None
    body_timeout_s: float = BODY_TIMEOUT_S
    hosts: frozenset[str] | None = None
    chat_template_timeout_s: float = CHAT_TEMPLATE_TIMEOUT_S


def default_max_request_bytes(max_model_len: int) -> int:
    """The body cap unless the command line sets one: room for a context-filling prompt, within
    MIN_MAX_REQUEST_BYTES..MAX_DEFAULT_REQUEST_BYTES whatever the model's config says."""
    return min(MAX_DEFAULT_REQUEST_BYTES, max(MIN_MAX_REQUEST_BYTES, BYTES_PER_CONTEXT_TOKEN * max_model_len))


def allowed_hosts(bound: str, extra: list[str] | tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host names a server bound to `bound` answers: loopback names, `bound` itself and
    `extra`; None (any) when bound to every interface, whose names the server cannot know."""
    if bound.strip("[]") in WILDCARD_HOSTS:
        return None
    bound = f"[{bound.strip('[]')}]" if ":" in bound else bound  # IPv6, as a Host header writes it
    return LOOPBACK_HOSTS | {host_name(h) for h in (bound, *extra)}


def host_name(host: str) -> str:
    """A Host header without its port, lower case: "[::1]:8000" -> "[::1]", "Example:80" -> "example"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else host


class HostCheck:
    def __init__(self, app, hosts: frozenset[str]):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host")
            # no Host header: HTTP/1.0, never a browser (which the check is about)
            name = host_name(header.decode("latin-1")) if header is not None else None
            if name is not None and name not in self.hosts:
                message = (
                    f"the Host header {name!r} does not name this server: use one of {', '.join(sorted(self.hosts))}, "
                    "or start optkit serve with --allowed-host or --api-key"
                )
                await error_response(403, message, code="invalid_host")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BearerAuth:
    """Every route needs the key but /health, which stays open (a load balancer's probe; it says
    only ok or not)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization")
            scheme, _, token = (header or b"").partition(b" ")
            if header is None or scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                message = "incorrect API key" if header else "missing API key: send Authorization: Bearer YOUR_KEY"
                response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        try:
            if length is not None and int(length) > self.max_bytes:
                raise _TooLarge
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)  # asyncio.timeout needs 3.11
        except _TooLarge:
            await self._refuse(
                413,
                f"the request body is over the server's limit of {self.max_bytes} bytes (--max-request-bytes)",
                scope,
                send,
            )
            return
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11
            message = f"the request body did not arrive within {self.timeout_s:g} s"
            await self._refuse(408, message, scope, send)
            return
        if body is None:  # the client went away
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()  # http.disconnect, for until_disconnected
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, status: int, message: str, scope, send) -> None:
        # the rest of the body is never read, so the connection cannot carry another request
        response = error_response(status, message, code=str(status), headers={"Connection": "close"})

        async def nothing():
            return {"type": "http.disconnect"}

        await response(scope, nothing, send)
