"""`optkit compile`: warm the engine (capture CUDA graphs on CUDA) into this machine's compile cache."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, console, print_json


def compile_(
    model: Annotated[str, typer.Argument(help="Model directory, artifact, or reference name (small, draft).")],
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated decode batch sizes to warm.")] = "1,8,32,64",
    out: Annotated[Path | None, typer.Option("--out", "-o", hidden=True)] = None,  # gone: says so
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available).")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on CUDA).")] = None,
    torch_compile: Annotated[
        bool, typer.Option("--torch-compile", help="Also torch.compile each decode bucket (CUDA only; experimental).")
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Warm the engine at each batch size and capture its decode CUDA graphs (CUDA), on the machine
    that will serve: the record (and torch.compile's cache with --torch-compile) goes into this
    machine's cache, $OPTKIT_CACHE/compile, keyed by the model's content hash, torch version and
    device. `serve` and `generate` look there, never in the model directory.

    Example: optkit compile out/small-w4 --batch-sizes 1,8,32
    """
    import sys

    from optkit.cli.bench import default_device, parse_batch_sizes
    from optkit.errors import OptkitError
    from optkit.runtime.compile_cache import compile_config, compile_model

    if out is not None:
        raise OptkitError(
            "--out is gone: compile caches are no longer shipped with a model (they can run code); "
            "run `optkit compile MODEL` on the serving machine, it warms $OPTKIT_CACHE/compile"
        )
    sizes = parse_batch_sizes(batch_sizes)
    config = compile_config(sizes, device or default_device(), dtype, torch_compile)
    manifest = compile_model(model, sizes, config, log_line=lambda line: print(line, file=sys.stderr))
    if json_output:
        print_json(manifest)
    else:
        where, name = manifest["path"], manifest["device_name"]
        console().print(f"warmed batch sizes {sizes} on {name}: {where}/compile.json", soft_wrap=True)
