"""Options shared by several commands, declared once."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.runtime.engine_args import EngineArgs

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace --out if it already exists.")]
OutDir = Annotated[Path, typer.Option("--out", "-o", help="Directory to write (created atomically).")]
EvalSet = Annotated[
    str, typer.Option("--eval-set", help="Bundled set name (heldout, calib) or a .txt/.jsonl/.parquet file.")
]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per evaluation window.")]


# ---------------------------------------------------------------- the engine's flags (runtime/engine_args.py)
# generate, serve, bench and compile share these. Each defaults to None, "not given", so that
# EngineArgs.from_cli_args keeps the field's default and a flag given to serve overrides only its
# key of a recipe's serve.engine section; the help shows EngineArgs' default.
def _engine_option(name: str, help: str, **kwargs):
    default = EngineArgs.model_fields[name].default
    flag = "--" + name.replace("_", "-")
    shown = "" if default is None or isinstance(default, bool) else f" (default: {default})"
    return typer.Option(flag, help=help + shown, show_default=False, **kwargs)


Device = Annotated[str | None, _engine_option("device", "cpu, cuda or cuda:N; auto: cuda when available, else cpu.")]
Dtype = Annotated[
    str | None, _engine_option("dtype", "float32, bfloat16 or float16; auto: bfloat16 on CUDA, float32 on CPU.")
]
MaxNumSeqs = Annotated[int | None, _engine_option("max_num_seqs", "Sequences decoded together.", min=1)]
MaxNumBatchedTokens = Annotated[
    int | None, _engine_option("max_num_batched_tokens", "Tokens computed per engine step.", min=1)
]
MaxModelLen = Annotated[
    int | None, _engine_option("max_model_len", "Context limit: prompt + max_tokens (default: the model's).", min=1)
]
Speculative = Annotated[
    str | None,
    _engine_option(
        "speculative",
        "Speculative decoding: 'ngram' (prompt lookup), 'draft:PATH' (a smaller model with the same tokenizer) "
        "or 'eagle:DIR' (an EAGLE head trained for this model: optkit speculator train).",
    ),
]
NumSpeculativeTokens = Annotated[
    int | None,
    _engine_option("num_speculative_tokens", "Tokens proposed per sequence and step (--speculative).", min=1),
]
NumSchedulerSteps = Annotated[
    int | None,
    _engine_option(
        "num_scheduler_steps",
        "Decode steps per schedule while every sequence decodes and none waits (multi-step decoding; default: "
        "8 on the CPU, 1 on CUDA and with --speculative). 1 returns to the scheduler after every token.",
        min=1,
    ),
]
KvCacheDtype = Annotated[
    str | None,
    _engine_option(
        "kv_cache_dtype",
        "KV cache: auto (the model's dtype), int8 or fp8 (8 bits, a scale per block and KV head; "
        "--kv-cache-blocks then counts blocks at the model's dtype: twice as many at 16 bits).",
    ),
]
EnforceEager = Annotated[
    bool | None,
    _engine_option("enforce_eager", "Run every step eagerly: no CUDA graphs for decode steps (CUDA)."),
]
Threads = Annotated[
    int | None, _engine_option("threads", "CPU threads for torch's kernels (default: every core torch sees).", min=1)
]
HeadSetting = Annotated[
    str,
    typer.Option(
        "--head",
        help="Output head (lm_head): auto (int8 where the format's serving runtime loads a quantized head, else "
        "full: today full everywhere, vLLM 0.32 loads none; docs/quantization.md), full (as stored), int8 (per "
        "channel; optkit runs it "
        "with int8 activations) or int4 (the artifact's group size), quantized by GPTQ on the final hidden states "
        "(else round to nearest) and gated like any layer. A tied head unties: the quantized head's bytes are "
        "added, the embedding stays (the manifest's head.added_bytes).",
    ),
]
TorchCompile = Annotated[
    bool | None,
    _engine_option("torch_compile", "Also torch.compile each decode bucket (CUDA only; experimental)."),
]
CompileDir = Annotated[
    Path | None,
    _engine_option(
        "compile_dir",
        "The compile cache (default: $OPTKIT_CACHE/compile): yours alone, as it holds code; no recipe can set it.",
    ),
]


def engine_flags(params: dict, *, exclude: tuple[str, ...] = ()) -> dict:
    """The engine flags a command was given, from its parameters (typer.Context.params): those named
    as EngineArgs fields, less `exclude` and those not given (None), so that EngineArgs' defaults hold."""
    from optkit.runtime.engine_args import given

    return given(
        {name: value for name, value in params.items() if name in EngineArgs.model_fields and name not in exclude}
    )


def require_supported(*models: str | None, runtime: bool = False) -> None:
    """Refuse a model whose config.json names a model_type no family supports (`runtime`: that the
    runtime does not run), in one line and before anything heavy is imported (quant/supported.py)."""
    from optkit.quant.supported import require_supported as require

    for model in models:
        if model:
            require(model, runtime=runtime)


def console():
    """stdout for people: a plain line is never wrapped, so paths and verdicts stay whole on one
    line for whoever reads them, at any terminal width (the terminal may fold it on screen)."""
    from rich.console import Console

    return Console(soft_wrap=True)


def print_table(table, out=None) -> None:
    """Print a table of names and numbers whole: on a terminal narrower than the table, its lines
    run past the edge, as plain lines do, instead of rich cutting names ("model.…") and numbers to
    fit. (Columns of free text should wrap instead: give them overflow="fold".)"""
    out = out or console()
    natural = out.measure(table, options=out.options.update_width(1 << 16)).maximum
    if natural > out.width:
        table.width = natural
    out.print(table)


def print_json(data) -> None:
    """`data` as strict JSON on stdout: NaN and infinities as null (optkit/json_strict.py)."""
    from optkit.json_strict import dumps

    print(dumps(data, indent=2, default=str))
