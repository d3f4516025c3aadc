"""`optkit serve`: an OpenAI-compatible HTTP server over the bundled runtime."""

from typing import Annotated

import typer

DEFAULT_HOST = "127.0.0.1"  # loopback: reachable from this machine only, unless --host says otherwise


def serve(
    model: Annotated[str, typer.Argument(help="Model directory, artifact, or reference name (small, draft).")],
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free one).")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="OPTKIT_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 (or OPTKIT_API_KEY)."),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model's name in the API (default: the model directory's name).")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Sequences decoded together.")] = 64,
    max_model_len: Annotated[
        int | None, typer.Option(min=1, help="Context limit: prompt + max_tokens (default: the model's).")
    ] = None,
    kv_cache_blocks: Annotated[
        int | None, typer.Option(min=1, help="KV cache blocks (default: max-num-seqs full-length sequences).")
    ] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="Tokens computed per engine step.")] = 512,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="Device to run the model on (cpu, cuda).")] = "cpu",
) -> None:
    """Serve a model with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, plus
    /health and /metrics (Prometheus). Prints one line once it accepts requests.

    Example: optkit serve out/small-w4 --port 8000 --served-model-name small-w4
    """
    import asyncio
    import sys
    from pathlib import Path

    from optkit.errors import OptkitError
    from optkit.runtime.async_engine import AsyncEngine
    from optkit.runtime.engine import EngineConfig

    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        kv_cache_blocks=kv_cache_blocks,
        dtype=dtype,
        device=device,
    )
    sock = bind(host, port)  # before loading the model: a port in use fails at once
    name = served_model_name or Path(model).resolve().name
    if not name:
        raise OptkitError(f"cannot name the model from {model!r}: pass --served-model-name")
    if not is_loopback(host) and not api_key:
        print(f"warning: serving on {host} without --api-key: anyone who can reach the port can use it", flush=True)
    engine = AsyncEngine.start(model, config, name)
    try:
        asyncio.run(run_server(engine, sock, api_key))
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        print("stopped", file=sys.stderr)
    finally:
        engine.shutdown()
        sock.close()


def bind(host: str, port: int):
    import socket

    from optkit.errors import OptkitError

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
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def run_server(engine, sock, api_key: str | None) -> None:
    import asyncio

    import uvicorn

    from optkit.server.app import build_app

    app = build_app(engine, api_key, shutdown_engine=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {engine.model_name} on http://{shown}:{port}", flush=True)
    await task
