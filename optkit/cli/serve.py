"""`optkit serve`: an OpenAI-compatible HTTP server over the bundled runtime."""

import typer

from optkit.cli import serve_options as opt
from optkit.cli.options import (
    CompileDir,
    Device,
    Dtype,
    EnforceEager,
    KvCacheDtype,
    MaxModelLen,
    MaxNumBatchedTokens,
    MaxNumSeqs,
    NumSchedulerSteps,
    NumSpeculativeTokens,
    Speculative,
    Threads,
    engine_flags,
    require_supported,
)

DEFAULT_HOST = "127.0.0.1"  # loopback: reachable from this machine only, unless --host says otherwise


def serve(
    ctx: typer.Context,
    model: opt.ModelArgument = None,
    models: opt.Models = None,
    kv_cache_fraction: opt.KvCacheFraction = None,
    task: opt.Tasks = None,
    recipe: opt.Recipe = None,
    route: opt.Route = None,
    tiers: opt.Tiers = None,
    max_queue_wait: opt.MaxQueueWait = None,
    prefix_min_tokens: opt.PrefixMinTokens = None,
    shadow: opt.Shadow = None,
    shadow_rate: opt.ShadowRate = None,
    fallback_threshold: opt.FallbackThreshold = None,
    fallback_window: opt.FallbackWindow = None,
    fallback_recovery: opt.FallbackRecovery = None,
    backends: opt.Backends = None,
    backend_key: opt.BackendKey = None,
    backend_tokenizer: opt.BackendTokenizer = None,
    backend_concurrency: opt.BackendConcurrency = None,
    backend_timeout: opt.BackendTimeout = None,
    host: opt.Host = DEFAULT_HOST,
    port: opt.Port = 8000,
    api_key: opt.ApiKey = None,
    max_request_bytes: opt.MaxRequestBytes = None,
    body_timeout: opt.BodyTimeout = 30.0,
    allowed_host: opt.AllowedHosts = None,
    docs: opt.Docs = False,
    served_model_name: opt.ServedModelName = None,
    max_num_seqs: MaxNumSeqs = None,
    max_model_len: MaxModelLen = None,
    kv_cache_blocks: opt.KvCacheBlocks = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    dtype: Dtype = None,
    device: Device = None,
    speculative: Speculative = None,
    num_speculative_tokens: NumSpeculativeTokens = None,
    num_scheduler_steps: NumSchedulerSteps = None,
    enforce_eager: EnforceEager = None,
    compile_dir: CompileDir = None,
    kv_cache_dtype: KvCacheDtype = None,
    threads: Threads = None,
) -> None:
    """Serve a model with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, plus
    /health and /metrics (Prometheus). Prints one line once it accepts requests.

    Several models (--model NAME=PATH, repeatable) are routed by --route.

    With --shadow QUANT=FULL, QUANT is measured against FULL online; --fallback-threshold moves its traffic to FULL.

    A recipe's serve: section (--recipe) configures the same; flags win (docs/serving.md).

    --backend NAME=URL serves an OpenAI-compatible upstream (a vLLM server) as NAME beside them.

    Example: optkit serve out/small-w4 --port 8000 --served-model-name small-w4

    Example: optkit serve --model w4=out/small-w4 --model small=small --shadow w4=small --fallback-threshold kld=0.05

    Example: optkit serve --model small=small --backend big=http://10.0.0.5:8000 --route tiered
    """
    require_supported(model, *(m.partition("=")[2] for m in models or []), runtime=True)
    from optkit.cli.serve_flags import ServeFlags, resolve_options
    from optkit.server.guards import Limits, allowed_hosts

    # kv_cache_blocks is per model (routing/startup.py); compile_dir is the command line's alone
    engine = engine_flags(ctx.params, exclude=("kv_cache_blocks", "compile_dir"))
    flags = ServeFlags.from_params(ctx.params, engine)
    options = resolve_options(model, served_model_name, None if recipe is None else str(recipe), flags)
    config = options.engine.engine_config()  # device "auto" resolved once, for every model
    if compile_dir is not None:  # the command line's alone: a recipe's serve.engine cannot name it
        config = config.model_copy(update={"compile_dir": str(compile_dir)})
    limits = Limits(max_request_bytes, body_timeout, allowed_hosts(host, allowed_host or []))
    serve_until_stopped(options, config, host, port, api_key, limits, docs)


def serve_until_stopped(options, config, host: str, port: int, api_key: str | None, limits, docs: bool) -> None:
    """Bind the port, load the models, serve until Ctrl-C, and shut the router down."""
    import asyncio
    import sys

    from optkit.routing.startup import describe, log_to_stderr, start_router
    from optkit.server.listen import bind, is_loopback, run_server

    sock = bind(host, port)  # before loading the models: a port in use fails at once
    if not is_loopback(host) and not api_key:
        print(f"warning: serving on {host} without --api-key: anyone who can reach the port can use it", flush=True)
    log_to_stderr()
    try:
        router = start_router(options, config)
    except BaseException:
        sock.close()
        raise
    try:
        asyncio.run(run_server(router, sock, api_key, describe(router), limits, docs))
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        print("stopped", file=sys.stderr)
    finally:
        router.shutdown()
        sock.close()
