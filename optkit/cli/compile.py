"""`optkit compile`: warm the engine (capture CUDA graphs on CUDA) into this machine's compile cache."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import (
    CompileDir,
    Device,
    Dtype,
    JsonFlag,
    TorchCompile,
    console,
    print_json,
    require_supported,
)


def compile_(
    model: Annotated[str, typer.Argument(help="Model directory, artifact, or reference name (small, draft).")],
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated decode batch sizes to warm.")] = "1,8,32,64",
    out: Annotated[Path | None, typer.Option("--out", "-o", hidden=True)] = None,  # gone: says so
    device: Device = None,
    dtype: Dtype = None,
    torch_compile: TorchCompile = None,
    compile_dir: CompileDir = None,
    json_output: JsonFlag = False,
) -> None:
    """Warm the engine at each batch size and capture its decode CUDA graphs (CUDA), on the machine
    that will serve: the record (and torch.compile's cache with --torch-compile) goes into this
    machine's cache, $OPTKIT_CACHE/compile (or --compile-dir), keyed by the model's content hash,
    torch version and device. `serve` and `generate` look there, never in the model directory.

    Example: optkit compile out/small-w4 --batch-sizes 1,8,32
    """
    import sys

    require_supported(model, runtime=True)
    from optkit.cli.bench import parse_batch_sizes
    from optkit.errors import OptkitError
    from optkit.runtime.engine_args import EngineArgs
    from optkit.runtime.warmup import compile_model

    if out is not None:
        raise OptkitError(
            "--out is gone: compile caches are no longer shipped with a model (they can run code); "
            "run `optkit compile MODEL` on the serving machine, it warms $OPTKIT_CACHE/compile"
        )
    sizes = parse_batch_sizes(batch_sizes)
    args = EngineArgs.from_cli_args(
        device=device,
        dtype=dtype,
        torch_compile=torch_compile,
        compile_dir=None if compile_dir is None else str(compile_dir),
        max_num_seqs=max(sizes),
    )
    config = args.engine_config()  # room for the largest batch size
    manifest = compile_model(model, sizes, config, log_line=lambda line: print(line, file=sys.stderr))
    if json_output:
        print_json(manifest)
    else:
        where, name = manifest["path"], manifest["device_name"]
        console().print(f"warmed batch sizes {sizes} on {name}: {where}/compile.json", soft_wrap=True)
