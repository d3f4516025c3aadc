"""Listening: the socket (bound before any model loads, so a port in use fails at once) and
uvicorn serving the app on it until stopped."""

import asyncio
import ipaddress
import socket

import uvicorn

from optkit.errors import OptkitError
from optkit.server.app import build_app
from optkit.server.guards import Limits
from optkit.server.transport import KEEP_ALIVE_S, HeadDeadlineProtocol


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise OptkitError(f"--host {host}: cannot resolve it ({e.strerror}): give an address such as 127.0.0.1") from e
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OptkitError(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port") from e
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def run_server(
    engine,
    sock: socket.socket,
    api_key: str | None,
    served: str | None = None,
    limits: Limits | None = None,
    docs: bool = False,
) -> None:
    """Serves `engine` (an AsyncEngine or a routing Router) until stopped; `served` names what is
    served in the line printed once it accepts requests (default: the engine's model name);
    `limits`: the server's Limits (server/guards.py); `docs`: serve FastAPI's API pages too."""
    app = build_app(engine, api_key, shutdown_engine=True, limits=limits, docs=docs)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=HeadDeadlineProtocol,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {served or engine.model_name} on http://{shown}:{port}", flush=True)
    await task
