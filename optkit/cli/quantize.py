"""`optkit quantize`."""

from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, OutDir, Overwrite, console, print_json


def quantize(
    out: OutDir,
    model: Annotated[str, typer.Argument(help="Model directory or reference model name.")] = "small",
    method: Annotated[
        str, typer.Option(help="rtn, gptq, awq (weight-only) or w8a8, smoothquant, smoothquant+gptq (int8 W8A8).")
    ] = "rtn",
    bits: Annotated[int | None, typer.Option(help="Weight bits: 2, 3, 4 or 8 [default: 4; W8A8: 8].")] = None,
    group_size: Annotated[
        int | None, typer.Option(help="Input columns per scale; -1 = per channel [default: 128; W8A8: -1].")
    ] = None,
    symmetric: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric or asymmetric integers.")] = True,
    ignore: Annotated[
        list[str] | None, typer.Option(help="Glob of layer names to keep in full precision (repeatable).")
    ] = None,
    format: Annotated[
        str, typer.Option(help="Checkpoint format: compressed-tensors, gptq or awq.")
    ] = "compressed-tensors",
    calib: Annotated[
        str, typer.Option(help="Calibration data: bundled set name or .txt/.jsonl/.parquet/datasets dir.")
    ] = "calib",
    num_samples: Annotated[int, typer.Option(help="Calibration sequences.")] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration sequence.")] = 256,
    seed: Annotated[int, typer.Option(help="Seed of the calibration sampling.")] = 0,
    damp: Annotated[float, typer.Option(help="GPTQ dampening, a fraction of the mean Hessian diagonal.")] = 0.01,
    block_size: Annotated[int, typer.Option(help="GPTQ lazy-batch block size.")] = 128,
    act_order: Annotated[bool, typer.Option(help="GPTQ: quantize columns by descending Hessian diagonal.")] = False,
    static_groups: Annotated[bool, typer.Option(help="GPTQ: fix group parameters before reordering.")] = False,
    alpha: Annotated[str, typer.Option(help="SmoothQuant migration strength in [0, 1], or auto.")] = "0.5",
    act_quant: Annotated[str, typer.Option(help="W8A8 activations: dynamic (per token) or static.")] = "dynamic",
    device: Annotated[str, typer.Option(help="Compute device for calibration: auto, cpu, cuda, cuda:N.")] = "auto",
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
) -> None:
    """Quantize the decoder's linear layers and write a loadable artifact.

    Example: optkit quantize small --method gptq --bits 4 --group-size 128 --act-order --static-groups --out out/w4

    Example: optkit quantize small --method smoothquant --alpha auto --out out/w8a8
    """
    from optkit.errors import OptkitError
    from optkit.quant.calibrate import CalibrationOptions
    from optkit.quant.gptq import GPTQOptions
    from optkit.quant.quantize import FORMATS, METHODS, W8A8_METHODS, QuantizeOptions, quantize_model
    from optkit.quant.smoothquant_layer import SmoothQuantOptions
    from optkit.weights.schemes import SUPPORTED_BITS, WeightScheme

    if method not in METHODS:
        raise OptkitError(f"unknown --method {method!r}: choose one of {', '.join(METHODS)}")
    w8a8 = method in W8A8_METHODS
    if w8a8 and (bits not in (None, 8) or group_size not in (None, -1) or not symmetric):
        raise OptkitError(f"--method {method} quantizes to int8 per output channel: drop --bits/--group-size/--asym")
    bits = bits if bits is not None else (8 if w8a8 else 4)
    group_size = group_size if group_size is not None else (-1 if w8a8 else 128)
    if alpha != "auto":
        try:
            alpha_value: float | str = float(alpha)
        except ValueError:
            alpha_value = -1.0
        if not 0 <= alpha_value <= 1:
            raise OptkitError(f"--alpha {alpha} is invalid: give a number in [0, 1] or auto")
    else:
        alpha_value = "auto"
    if act_quant not in ("dynamic", "static"):
        raise OptkitError(f"--act-quant {act_quant!r} is invalid: choose dynamic or static")
    if format not in FORMATS:
        raise OptkitError(f"unknown --format {format!r}: choose one of {', '.join(FORMATS)}")
    if bits not in SUPPORTED_BITS:
        raise OptkitError(f"--bits {bits} is not supported: choose one of {', '.join(map(str, SUPPORTED_BITS))}")
    if group_size != -1 and group_size <= 0:
        raise OptkitError(f"--group-size {group_size} is invalid: give a positive size or -1 for per channel")
    if not method.endswith("gptq") and (act_order or static_groups):
        raise OptkitError("--act-order and --static-groups are GPTQ options: add --method gptq")
    if damp < 0 or block_size < 1:
        raise OptkitError("--damp must be ≥ 0 and --block-size ≥ 1")
    options = QuantizeOptions(
        method=method,
        format=format,
        ignore=ignore or [],
        weights=WeightScheme(bits=bits, group_size=group_size, symmetric=symmetric),
        gptq=GPTQOptions(damp=damp, block_size=block_size, act_order=act_order, static_groups=static_groups),
        calibration=CalibrationOptions(calib=calib, num_samples=num_samples, seq_len=seq_len, seed=seed),
        smoothquant=SmoothQuantOptions(alpha=alpha_value, activations=act_quant),
    )
    warn_if_unloadable(options)
    manifest = quantize_model(model, out, options, overwrite=overwrite, device=device)
    if json_output:
        print_json(manifest)
        return
    layers = manifest["layers"]
    summary = f"mean rel. weight error {sum(x['rel_error'] for x in layers) / len(layers):.4f}"
    if method == "gptq":
        loss, rtn_loss = sum(x["loss"] for x in layers), sum(x["rtn_loss"] for x in layers)
        summary += f", output error {loss:.4g} (RTN {rtn_loss:.4g})"
    peak = manifest["peak_memory"]
    for label, value in (("peak GPU memory", peak["cuda_bytes"]), ("peak RSS", peak["rss_bytes"])):
        if value is not None:
            summary += f", {label} {value / 2**20:.0f} MB"
            break
    console().print(
        f"[bold green]wrote[/] {out}  ({method} {options.weights.describe()}, {len(layers)} layers, "
        f"{summary}, {manifest['wall_time_s']:.1f}s)"
    )


def warn_if_unloadable(options) -> None:
    """One line on stderr when the installed loaders cannot read what is about to be written."""
    from optkit.compat.matrix import ArtifactKind, check_installed_versions
    from optkit.quant.quantize import W8A8_METHODS

    w = options.weights
    kind = ArtifactKind(options.format, w.bits, w.symmetric, w8a8=options.method in W8A8_METHODS)
    warning = check_installed_versions(kind)
    if warning:
        typer.echo(f"warning: {warning}", err=True)
