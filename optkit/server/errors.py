"""Every failure as OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`.

A client's mistake is never a 500: FastAPI's 422 for a malformed or mistyped body becomes a 400
whose message names the parameter, unknown routes keep their 404/405, and only a failure of the
server itself is a 500 (type `server_error`), whose body never carries the exception's text (it
may hold a path, a prompt or a secret): the traceback goes to the server's log.

The router knows nothing of HTTP: it raises domain errors (routing/errors.py), and `ROUTING_ERRORS`
gives each its status, parameter and code here, as vLLM's app maps its engine's errors.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from optkit.routing.errors import RoutingError, UnknownModel, UnknownTier
from optkit.server.protocol import ErrorDetail, ErrorResponse
from optkit.upstream.engine import UpstreamError

logger = logging.getLogger("optkit.server")
SERVER_ERROR = "internal server error: the server's log has the details"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        message = self.message.encode("utf-8", "backslashreplace").decode()  # a lone surrogate would fail the encoding
        body = ErrorResponse(error=ErrorDetail(message=message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


# A routing error -> (status, param, code); its message is the body's message.
ROUTING_ERRORS: dict[type[RoutingError], tuple[int, str | None, str | None]] = {
    UnknownModel: (404, "model", "model_not_found"),
    UnknownTier: (400, None, None),
}


def routing_error(exc: RoutingError) -> APIError:
    status, param, code = ROUTING_ERRORS.get(type(exc), (400, None, None))
    return APIError(status, str(exc), param=param, code=code)


def upstream_error(exc: UpstreamError) -> APIError:
    """An upstream's failure: its own 4xx message as a client error, else a 502 or 504 naming it."""
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return APIError(exc.status, str(exc), type=kind, code="upstream_error" if exc.status >= 500 else None)


class ClientDisconnected(Exception):
    """The client went away before its response was ready; nothing is sent."""


def error_response(status: int, message: str, **fields) -> JSONResponse:
    """OpenAI's error body with this status; `fields`: APIError's type, param, code and headers."""
    return APIError(status, message, **fields).response()


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors for a request body -> one 400 naming the first bad parameter."""
    first = errors[0]
    kind = first.get("type", "")
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the body is not valid JSON ({detail})" if detail else "the body is not valid JSON")
    if not loc:
        if kind == "missing":
            return APIError(400, "the request needs a JSON body")
        if kind in ("model_attributes_type", "model_type", "dict_type"):
            return APIError(400, "the body must be a JSON object")
    param = _param(loc)
    same = [e for e in errors if _param([str(p) for p in e.get("loc", ())][1:]) == param]
    messages = dict.fromkeys(str(e.get("msg", "invalid value")).removeprefix("Value error, ") for e in same)
    message = "; or ".join(messages)  # several when a union's every member failed
    if kind == "extra_forbidden":
        message = f"unknown parameter {param!r}: optkit serve does not support it"
    elif kind == "missing":
        message = f"{param} is required"
    elif param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code=kind or None)


def _param(loc: list[str]) -> str | None:
    """("messages", "0", "role") -> "messages.0.role"; a union member's tag ("prompt", "list[int]",
    "0") and what follows it are dropped, so the members' errors share their parameter ("prompt")."""
    parts = []
    for part in loc:
        if "[" in part or part in _TYPE_TAGS:
            break
        parts.append(part)
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "StreamOptions"}


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def unroutable(request: Request, exc: RoutingError) -> Response:
        return routing_error(exc).response()

    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        error = validation_error(list(exc.errors()))
        if error.param is None and "json" not in request.headers.get("content-type", "json"):
            error.message = f"{error.message}: send it with Content-Type: application/json"
        return error.response()

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return error_response(exc.status_code, str(message), code=str(exc.status_code), headers=exc.headers)

    async def upstream_failed(request: Request, exc: UpstreamError) -> Response:
        return upstream_error(exc).response()

    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody receives it

    async def server_error(request: Request, exc: Exception) -> Response:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, SERVER_ERROR, type="server_error")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RoutingError, unroutable)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(UpstreamError, upstream_failed)
    app.add_exception_handler(ClientDisconnected, disconnected)
    app.add_exception_handler(Exception, server_error)
