"""`optkit compile`: warm the engine (capture CUDA graphs on CUDA) and store what serve/generate reuse."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, console, print_json


def compile_(
    model: Annotated[str, typer.Argument(help="Model directory, artifact, or reference name (small, draft).")],
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated decode batch sizes to warm.")] = "1,8,32,64",
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Directory to write compile/ into (default: the model's).")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available).")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on CUDA).")] = None,
    torch_compile: Annotated[
        bool, typer.Option("--torch-compile", help="Also torch.compile each decode bucket (CUDA only; experimental).")
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Warm the engine at each batch size, capture its decode CUDA graphs (CUDA), and write
    compile/compile.json (plus torch.compile's cache with --torch-compile), keyed by torch version
    and device name. `serve` and `generate` load a model's compile/ when present.

    Example: optkit compile out/small-w4 --batch-sizes 1,8,32 --out out/small-w4
    """
    import sys

    from optkit.cli.bench import default_device, parse_batch_sizes
    from optkit.runtime.compile_cache import compile_config, compile_model

    sizes = parse_batch_sizes(batch_sizes)
    config = compile_config(sizes, device or default_device(), dtype, torch_compile)
    manifest = compile_model(model, out, sizes, config, log_line=lambda line: print(line, file=sys.stderr))
    if json_output:
        print_json(manifest)
    else:
        where, name = manifest["path"], manifest["device_name"]
        console().print(f"wrote {where}/compile.json: warmed batch sizes {sizes} on {name}")
