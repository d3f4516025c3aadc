"""`optkit generate`: run prompts through the bundled runtime (continuous batching, paged KV cache)."""

import json
from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import (
    Device,
    Dtype,
    EnforceEager,
    JsonFlag,
    KvCacheDtype,
    MaxNumSeqs,
    NumSchedulerSteps,
    NumSpeculativeTokens,
    Speculative,
    Threads,
    console,
    engine_flags,
    print_json,
    require_supported,
)

SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "speculative"}


def generate(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Model directory, artifact, or reference name (small, draft).")],
    prompt: Annotated[str | None, typer.Argument(help="The prompt (or use --prompts).")] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(help='A .jsonl file of {"prompt": ...} lines, each may set max_tokens, temperature, ...'),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling: keep the smallest set with this mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0: all).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it is generated.")] = False,
    max_num_seqs: MaxNumSeqs = None,
    device: Device = None,
    dtype: Dtype = None,
    speculative: Speculative = None,
    num_speculative_tokens: NumSpeculativeTokens = None,
    num_scheduler_steps: NumSchedulerSteps = None,
    enforce_eager: EnforceEager = None,
    kv_cache_dtype: KvCacheDtype = None,
    threads: Threads = None,
    json_output: JsonFlag = False,
) -> None:
    """Generate text with the bundled runtime.

    Example: optkit generate small "def fibonacci(n):" --max-tokens 48
    Example: optkit generate out/small-w4 --prompts prompts.jsonl --json
    Example: optkit generate small "def f(x):" --speculative draft:draft --num-speculative-tokens 4
    """
    require_supported(model, runtime=True)
    from optkit.errors import OptkitError
    from optkit.runtime.engine import LLMEngine
    from optkit.runtime.engine_args import EngineArgs

    if (prompt is None) == (prompts is None):
        raise OptkitError('give one prompt or --prompts FILE.jsonl (e.g. optkit generate small "def f(x):")')
    defaults = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    requests = [{"prompt": prompt}] if prompts is None else read_prompts(prompts)
    params = sampling_params(requests, defaults)
    engine = LLMEngine(model, EngineArgs.from_cli_args(**engine_flags(ctx.params)).engine_config())
    token_ids = [engine.tokenizer.encode(r["prompt"]) for r in requests]
    check_requests(engine, token_ids, params)
    texts = [""] * len(requests)
    reasons: list[str | None] = [None] * len(requests)
    show_stream = stream and len(requests) == 1 and not json_output

    def on_output(i: int, output) -> None:
        texts[i] += output.text
        reasons[i] = output.finish_reason
        if show_stream:
            print(output.text, end="", flush=True)

    outputs = engine.generate(token_ids, params, on_output)
    results = [
        {"prompt": r["prompt"], "text": t, "token_ids": o, "finish_reason": f}
        for r, t, o, f in zip(requests, texts, outputs, reasons, strict=True)
    ]
    if json_output:
        print_json(results if prompts is not None else results[0])
    elif show_stream:
        print()
    else:
        print_results(results)


def sampling_params(requests: list[dict], defaults: dict) -> list:
    """Each request's SamplingParams: its own keys over the command line's; a user error naming the prompt."""
    from optkit.errors import OptkitError
    from optkit.runtime.sequence import SamplingParams

    params = []
    for i, request in enumerate(requests):
        try:
            params.append(SamplingParams(**{**defaults, **{k: v for k, v in request.items() if k != "prompt"}}))
        except (TypeError, ValueError) as e:
            raise OptkitError(f"prompt {i + 1}: {e}") from None
    return params


def check_requests(engine, token_ids: list[list[int]], params: list) -> None:
    """A user error naming the first prompt that is empty or that the engine cannot take."""
    from optkit.errors import OptkitError

    for i, ids in enumerate(token_ids):
        if not ids:
            raise OptkitError(f"prompt {i + 1} is empty: give some text")
        try:
            engine.check_request(ids, params[i])
        except ValueError as e:
            raise OptkitError(f"prompt {i + 1}: {e}: lower --max-tokens or shorten the prompt") from None


def read_prompts(path: Path) -> list[dict]:
    from optkit.errors import OptkitError

    if not path.is_file():
        raise OptkitError(f"--prompts {path}: no such file")
    requests = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            raise OptkitError(f"{path}:{n}: not JSON ({e.msg}): write one JSON object per line") from None
        if not isinstance(request, dict) or not isinstance(request.get("prompt"), str):
            raise OptkitError(f'{path}:{n}: each line needs a "prompt" string')
        unknown = set(request) - SAMPLING_KEYS - {"prompt"}
        if unknown:
            raise OptkitError(f"{path}:{n}: unknown key {sorted(unknown)[0]!r}: use {', '.join(sorted(SAMPLING_KEYS))}")
        requests.append(request)
    if not requests:
        raise OptkitError(f"--prompts {path} has no prompts")
    return requests


def print_results(results: list[dict]) -> None:
    from rich.table import Table

    table = Table("#", "prompt", "completion", "tokens", "finish")
    for i, r in enumerate(results, 1):
        table.add_row(str(i), r["prompt"], r["text"], str(len(r["token_ids"])), r["finish_reason"] or "")
    console().print(table)
