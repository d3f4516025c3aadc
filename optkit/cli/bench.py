"""`optkit bench`: the engine's decode throughput and latency against transformers, in one run."""

from typing import Annotated

import typer

from optkit.cli.options import (
    Device,
    Dtype,
    EnforceEager,
    JsonFlag,
    NumSchedulerSteps,
    NumSpeculativeTokens,
    Speculative,
    console,
    print_json,
    print_table,
    require_supported,
)


def parse_batch_sizes(text: str) -> list[int]:
    from optkit.errors import OptkitError

    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise OptkitError(f"--batch-sizes {text!r}: give positive integers separated by commas, e.g. 1,8,32") from None
    if not sizes or min(sizes) < 1:
        raise OptkitError(f"--batch-sizes {text!r}: give positive integers separated by commas, e.g. 1,8,32")
    return sizes


def bench(
    model: Annotated[str, typer.Argument(help="Model directory, artifact, or reference name (small, draft).")],
    baseline: Annotated[
        list[str] | None,
        typer.Option(
            help="hf (transformers generate), eager (the engine without CUDA graphs) or vllm (vLLM on the "
            "same model, at its defaults and eager; needs --vllm-python); repeatable."
        ),
    ] = None,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8,32,64",
    prompt_len: Annotated[int, typer.Option(min=1, help="Prompt tokens per request (random ids).")] = 128,
    gen_len: Annotated[int, typer.Option(min=1, help="Tokens generated per request (EOS ignored).")] = 128,
    device: Device = None,
    dtype: Dtype = None,
    enforce_eager: EnforceEager = None,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads for torch (default: all it sees).")] = None,
    vllm_python: Annotated[
        str | None,
        typer.Option(help="Python of vLLM's own venv (`make vllm`), for --baseline vllm; default $OPTKIT_VLLM_PYTHON."),
    ] = None,
    speculative: Speculative = None,
    num_speculative_tokens: NumSpeculativeTokens = None,
    num_scheduler_steps: NumSchedulerSteps = None,
    json_output: JsonFlag = False,
) -> None:
    """Output tokens/s, TTFT and TPOT p50/p95/p99 of the engine, the baselines at the same batch
    sizes, and the ratios; on CUDA also the batch-1 bandwidth ceiling (weight bytes / copy bandwidth).

    Example: optkit bench small --baseline hf --batch-sizes 1,8 --prompt-len 64 --gen-len 32
    (--baseline vllm --vllm-python .venv-vllm/bin/python: vLLM-CPU's rows and the ratios against them;
    --speculative eagle:DIR: the engine speculates, against itself without speculation, and each row
    reports the mean acceptance length)
    """
    import sys

    require_supported(model, runtime=True)
    from optkit.devices import set_cpu_threads
    from optkit.errors import OptkitError
    from optkit.runtime.benchmark import BASELINES, BenchConfig, run_benchmark
    from optkit.runtime.engine_args import EngineArgs

    set_cpu_threads(threads)
    unknown = sorted(set(baseline or []) - set(BASELINES))
    if unknown:
        raise OptkitError(f"unknown --baseline {unknown[0]!r}: choose {' or '.join(BASELINES)}")
    python = None
    if "vllm" in (baseline or []):  # before any model loads: a missing venv is one line
        from optkit.engines.vllm import vllm_python as find_vllm_python

        python = str(find_vllm_python(vllm_python))
    engine = EngineArgs.from_cli_args(
        device=device,
        dtype=dtype,
        enforce_eager=enforce_eager,
        speculative=speculative,
        num_speculative_tokens=num_speculative_tokens,
        num_scheduler_steps=num_scheduler_steps,
    ).engine_config()
    config = BenchConfig(
        batch_sizes=parse_batch_sizes(batch_sizes),
        prompt_len=prompt_len,
        gen_len=gen_len,
        device=engine.device,
        dtype=engine.dtype,
        baselines=tuple(baseline or ()),
        enforce_eager=engine.enforce_eager,
        seed=seed,
        vllm_python=python,
        speculative=engine.speculative,
        num_speculative_tokens=engine.num_speculative_tokens,
        num_scheduler_steps=engine.num_scheduler_steps,
    )
    result = run_benchmark(model, config, log=lambda line: print(line, file=sys.stderr, flush=True))
    if json_output:
        print_json(result)
    else:
        show(result)


def show(result: dict) -> None:
    from rich.table import Table

    title = (
        f"{result['model']} on {result['device_name']}, {result['dtype']}: "
        f"{result['prompt_len']} prompt + {result['gen_len']} new tokens"
    )
    if result.get("speculative"):
        title += f", --speculative {result['speculative']} k={result['num_speculative_tokens']}"
    if result.get("num_scheduler_steps", 1) > 1:
        title += f", up to {result['num_scheduler_steps']} decode steps per schedule"
    table = Table(title=title)
    ratio_keys = sorted({k for row in result["rows"] for k in row if k.startswith("vs ")})
    columns = ["batch", "run", "tok/s", *ratio_keys, "TTFT p50/p95/p99 ms", "TPOT p50/p95/p99 ms"]
    speculating = any("mean_acceptance_length" in row for row in result["rows"])
    if speculating:
        columns.append("accept len")
    if "ceiling" in result:
        columns.append("of ceiling")
    for column in columns:
        table.add_column(column, justify="left" if column == "run" else "right")

    def ms(p: dict) -> str:
        return "/".join(f"{p[k] * 1e3:.1f}" for k in ("p50", "p95", "p99"))

    for row in result["rows"]:
        cells = [str(row["batch_size"]), row["run"], f"{row['tokens_per_s']:.1f}"]
        cells += [f"{row[k]:.2f}x" if k in row else "" for k in ratio_keys]
        cells += [ms(row["ttft_s"]), ms(row["tpot_s"])]
        if speculating:
            length = row.get("mean_acceptance_length")
            cells.append("" if length is None else f"{length:.2f}")
        if "ceiling" in result:
            cells.append(f"{row['fraction_of_ceiling']:.0%}" if "fraction_of_ceiling" in row else "")
        table.add_row(*cells)
    print_table(table)
    if "vllm" in result:
        v = result["vllm"]
        loads = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in v["load_s"].items())
        console().print(f"vLLM {v['version']} in {v['dtype']} (loads: {loads})")
        for name, message in v.get("refused", {}).items():
            console().print(f"{name} refused the model: {message}")
    for kernel, count in result.get("kernels", {}).items():
        console().print(f"{count} layers: {kernel}")
    if result.get("decode_operators"):
        console().print(f"RMSNorm, RoPE, decode attention: {result['decode_operators']}")
    if result.get("step_overhead"):
        o = result["step_overhead"]
        console().print(
            f"engine overhead per decoded token (batch 1): {o['overhead_s'] * 1e3:.2f} ms of "
            f"{o['step_s'] * 1e3:.2f} ms ({o['overhead_share']:.1%}), median of {o['steps']} engine steps "
            f"({o['tokens']} tokens)"
        )
    if "ceiling" in result:
        c = result["ceiling"]
        console().print(
            f"batch-1 ceiling: {c['weight_bytes'] / 1e9:.2f} GB of weights at {c['copy_bytes_per_s'] / 1e12:.2f} TB/s "
            f"= {c['batch1_tokens_per_s']:.0f} tokens/s"
        )
