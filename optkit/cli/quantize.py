"""`optkit quantize`."""

from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, OutDir, Overwrite, console, print_json


def quantize(
    out: OutDir,
    model: Annotated[str, typer.Argument(help="Model directory or reference model name.")] = "small",
    method: Annotated[str, typer.Option(help="Quantization method: rtn.")] = "rtn",
    bits: Annotated[int, typer.Option(help="Weight bits: 2, 3, 4 or 8.")] = 4,
    group_size: Annotated[
        int, typer.Option("--group-size", help="Input columns per scale; -1 = per output channel.")
    ] = 128,
    symmetric: Annotated[
        bool, typer.Option("--sym/--asym", help="Symmetric (zero point 0) or asymmetric integers.")
    ] = True,
    ignore: Annotated[
        list[str] | None, typer.Option("--ignore", help="Glob of layer names to keep in full precision (repeatable).")
    ] = None,
    format: Annotated[
        str, typer.Option("--format", help="Checkpoint format: compressed-tensors.")
    ] = "compressed-tensors",
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
) -> None:
    """Quantize the decoder's linear layers and write a loadable artifact.

    Example: optkit quantize small --method rtn --bits 4 --group-size 128 --out out/small-w4
    """
    from optkit.errors import OptkitError
    from optkit.quant.quantize import FORMATS, METHODS, QuantizeOptions, quantize_model
    from optkit.quant.schemes import SUPPORTED_BITS, WeightScheme

    if method not in METHODS:
        raise OptkitError(f"unknown --method {method!r}: choose one of {', '.join(METHODS)}")
    if format not in FORMATS:
        raise OptkitError(f"unknown --format {format!r}: choose one of {', '.join(FORMATS)}")
    if bits not in SUPPORTED_BITS:
        raise OptkitError(f"--bits {bits} is not supported: choose one of {', '.join(map(str, SUPPORTED_BITS))}")
    if group_size != -1 and group_size <= 0:
        raise OptkitError(f"--group-size {group_size} is invalid: give a positive size or -1 for per channel")
    options = QuantizeOptions(
        method=method,
        format=format,
        ignore=ignore or [],
        weights=WeightScheme(bits=bits, group_size=group_size, symmetric=symmetric),
    )
    manifest = quantize_model(model, out, options, overwrite=overwrite)
    if json_output:
        print_json(manifest)
        return
    errors = [layer["rel_error"] for layer in manifest["layers"]]
    console().print(
        f"[bold green]wrote[/] {out}  ({options.weights.describe()}, {len(errors)} layers, "
        f"mean rel. weight error {sum(errors) / len(errors):.4f}, {manifest['wall_time_s']:.1f}s)"
    )
