"""`optkit quantize`."""

from typing import Annotated

import typer
from typer.core import TyperCommand

from optkit.cli.options import JsonFlag, OutDir, Overwrite, console, print_json, require_supported


def quantize(
    out: OutDir = None,
    model: Annotated[str, typer.Argument(help="Model directory or reference model name.")] = "small",
    method: Annotated[str, typer.Option(help="Quantization method (the registered ones are listed below).")] = "rtn",
    bits: Annotated[int | None, typer.Option(help="Weight bits: 2, 3, 4 or 8 [default: 4; W8A8: 8].")] = None,
    group_size: Annotated[
        int | None, typer.Option(help="Input columns per scale; -1 = per channel [default: 128; W8A8: -1].")
    ] = None,
    symmetric: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric or asymmetric integers.")] = True,
    ignore: Annotated[
        list[str] | None, typer.Option(help="Glob of layer names to keep in full precision (repeatable).")
    ] = None,
    format: Annotated[
        str | None,
        typer.Option(
            help="Checkpoint format (the registered ones are listed below) "
            "[default: compressed-tensors; nf4: bitsandbytes]."
        ),
    ] = None,
    calib: Annotated[
        str, typer.Option(help="Calibration data: bundled set name or .txt/.jsonl/.parquet/datasets dir.")
    ] = "calib",
    num_samples: Annotated[int, typer.Option(help="Calibration sequences.")] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration sequence.")] = 256,
    seed: Annotated[int, typer.Option(help="Seed of the calibration sampling.")] = 0,
    moe_calibration: Annotated[
        str,
        typer.Option(
            help="Mixture-of-experts models: 'all' sends every calibration token through every expert for its "
            "statistics, weighted by the router (its squared routing weight; the output still follows the router); "
            "'routed' only the tokens the router chooses."
        ),
    ] = "all",
    quantize_router: Annotated[
        bool,
        typer.Option(
            "--quantize-router", help="Mixture-of-experts models: quantize the routers too (default: full precision)."
        ),
    ] = False,
    damp: Annotated[float, typer.Option(help="GPTQ dampening, a fraction of the mean Hessian diagonal.")] = 0.01,
    block_size: Annotated[int, typer.Option(help="GPTQ lazy-batch block size.")] = 128,
    act_order: Annotated[
        bool | None,
        typer.Option(
            "--act-order/--no-act-order",
            help="GPTQ: quantize columns by descending Hessian diagonal (default: off; on for GGUF Q4_0).",
        ),
    ] = None,
    static_groups: Annotated[
        bool | None,
        typer.Option(
            "--static-groups/--no-static-groups",
            help="GPTQ: fix group parameters before reordering (default: off; on for GGUF Q4_0).",
        ),
    ] = None,
    alpha: Annotated[str, typer.Option(help="SmoothQuant migration strength in [0, 1], or auto.")] = "auto",
    act_quant: Annotated[str, typer.Option(help="W8A8 activations: dynamic (per token) or static.")] = "dynamic",
    double_quant: Annotated[bool, typer.Option(help="NF4: store the block scales in 8 bits (QLoRA).")] = False,
    device: Annotated[str, typer.Option(help="Compute device for calibration: auto, cpu, cuda, cuda:N.")] = "auto",
    target_kld: Annotated[
        float | None,
        typer.Option(help="Gate at this mean KLD; if the artifact fails, raise its most damaging layers (repair)."),
    ] = None,
    target_ppl_increase: Annotated[
        float | None, typer.Option(help="Gate (and repair) at this perplexity increase, percent.")
    ] = None,
    max_size_mb: Annotated[float | None, typer.Option(help="Repair: size budget of the weights, MiB.")] = None,
    max_evaluations: Annotated[int, typer.Option(help="Repair: gate evaluations at most.", min=1)] = 8,
    repair_start: Annotated[
        str,
        typer.Option(
            help="Repair: 'artifact' raises layers of the artifact quantized as asked; 'smallest' quantizes on the "
            "ladder's smallest rung (2-bit g128) and raises from there, for the smallest artifact that passes."
        ),
    ] = "artifact",
    gate_windows: Annotated[int | None, typer.Option(help="Repair: the gate's windows at most (default: all).")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan: linears by group, what stays, size, peak memory.")
    ] = False,
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
) -> None:
    """Quantize the decoder's linear layers and write a loadable artifact.

    Example: optkit quantize small --method gptq --bits 4 --group-size 128 --act-order --static-groups --out out/w4

    Example: optkit quantize small --method smoothquant --alpha auto --out out/w8a8
    """
    require_supported(model)
    from optkit.errors import OptkitError
    from optkit.quant import methods
    from optkit.quant.calibration_data import CalibrationOptions
    from optkit.quant.moe import MOE_CALIBRATION

    if moe_calibration not in MOE_CALIBRATION:
        raise OptkitError(f"--moe-calibration {moe_calibration!r}: choose one of {', '.join(MOE_CALIBRATION)}")
    from optkit.quant.formats import format_names
    from optkit.quant.gptq import GPTQOptions
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.quant.smoothquant_layer import SmoothQuantOptions
    from optkit.weights.schemes import SUPPORTED_BITS, WeightScheme

    if method not in methods.method_names():
        raise OptkitError(f"unknown --method {method!r}: choose one of {', '.join(methods.method_names())}")
    fixed = methods.resolve(method).fixed_weights
    if fixed is not None and (
        bits not in (None, fixed.bits) or group_size not in (None, fixed.group_size) or symmetric != fixed.symmetric
    ):
        raise OptkitError(f"--method {method} quantizes to {fixed.describe()}: drop --bits/--group-size/--asym")
    bits = bits if bits is not None else (fixed.bits if fixed else 4)
    weights_stage = methods.resolve(method).weights
    if format is None:  # the method's own format when it has one (nf4: bitsandbytes)
        formats = weights_stage.formats if weights_stage is not None else None
        format = formats[0] if formats else "compressed-tensors"
    weight_type = fixed.type if fixed else weights_stage.weight_type if weights_stage else "int"
    default_group = 64 if weight_type == "nf4" else 128  # bitsandbytes' NF4 block
    group_size = group_size if group_size is not None else (fixed.group_size if fixed else default_group)
    if double_quant and weight_type != "nf4":
        raise OptkitError(f"--double-quant quantizes NF4's block scales: use it with --method nf4, not {method}")
    alpha_value: float | str = alpha
    if alpha != "auto":
        try:
            alpha_value = float(alpha)
        except ValueError:
            pass  # SmoothQuantOptions names what it accepts
    smoothquant = _options(
        SmoothQuantOptions, {"alpha": "--alpha", "activations": "--act-quant"}, alpha=alpha_value, activations=act_quant
    )
    if format not in format_names():
        raise OptkitError(f"unknown --format {format!r}: choose one of {', '.join(format_names())}")
    if bits not in SUPPORTED_BITS:
        raise OptkitError(f"--bits {bits} is not supported: choose one of {', '.join(map(str, SUPPORTED_BITS))}")
    if group_size != -1 and group_size <= 0:
        raise OptkitError(f"--group-size {group_size} is invalid: give a positive size or -1 for per channel")
    gptq = _options(
        GPTQOptions,
        {"damp": "--damp", "block_size": "--block-size"},
        damp=damp,
        block_size=block_size,
        act_order=act_order,
        static_groups=static_groups,
    )
    options = _options(
        QuantizeOptions,
        {},
        method=method,
        format=format,
        ignore=ignore or [],
        weights=_options(
            WeightScheme,
            {"group_size": "--group-size", "bits": "--bits"},
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
            type=weight_type,
            double_quant=double_quant,
        ),
        gptq=gptq,
        calibration=CalibrationOptions(
            calib=calib, num_samples=num_samples, seq_len=seq_len, seed=seed, moe_calibration=moe_calibration
        ),
        smoothquant=smoothquant,
        quantize_router=quantize_router,
    )
    warn_if_unloadable(options, model)
    if dry_run:  # config.json and the safetensors headers only: nothing is loaded, run or written
        from optkit.cli.quantize_plan import print_plan

        print_plan(model, options, json_output)
        return
    if out is None:
        raise OptkitError("--out is missing: give the directory to write (or --dry-run to see the plan)")
    if target_kld is not None or target_ppl_increase is not None:
        gate = _repair_gate(target_kld, target_ppl_increase, max_size_mb, max_evaluations, gate_windows, repair_start)
        _quantize_and_repair(model, out, options, gate, device, overwrite, json_output)
        return
    manifest = quantize_model(model, out, options, overwrite=overwrite, device=device)
    if json_output:
        print_json(manifest)
        return
    layers = manifest["layers"]
    summary = f"mean rel. weight error {sum(x['rel_error'] for x in layers) / len(layers):.4f}"
    if all("rtn_loss" in x for x in layers):  # GPTQ's layers compare their output error with RTN's
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


def _repair_gate(target_kld, target_ppl_increase, max_size_mb, max_evaluations, gate_windows, repair_start):
    from optkit.gate.options import GateOptions, RepairOptions

    return _options(
        GateOptions,
        {"max_kld": "--target-kld", "max_ppl_increase": "--target-ppl-increase", "max_windows": "--gate-windows"},
        max_kld=target_kld,
        max_ppl_increase=target_ppl_increase,
        max_windows=gate_windows,
        repair=_options(
            RepairOptions,
            {"max_size_mb": "--max-size-mb", "max_evaluations": "--max-evaluations", "start": "--repair-start"},
            max_size_mb=max_size_mb,
            max_evaluations=max_evaluations,
            start=repair_start,
        ),
    )


def _quantize_and_repair(model, out, options, gate, device, overwrite, json_output) -> None:
    """--target-kld / --target-ppl-increase: the artifact that passes goes to --out (exit 0); when
    the budget cannot reach the target, the closest goes to OUT.rejected (exit 1, one line why)."""
    from optkit.pipeline.repair import quantize_and_repair, size_mb

    outcome = quantize_and_repair(
        model, out, options, gate, overwrite=overwrite, device=device, log=lambda line: console().print(line)
    )
    if json_output:
        print_json({"passed": outcome.passed, "artifact": str(outcome.artifact), "steps": outcome.steps})
    else:
        first = outcome.steps[0]
        kld = outcome.gate.metrics["kld_mean"]
        console().print(
            f"[bold {'green' if outcome.passed else 'red'}]wrote[/] {outcome.artifact}  (KLD {first['kld_mean']:.5f} "
            f"-> {kld:.5f}, {len(outcome.raised)} linears raised, {size_mb(outcome.artifact):.2f} MB, "
            f"{len(outcome.steps) - 1} repair evaluations)"
        )
    if not outcome.passed:
        typer.echo(f"error: {outcome.reason}", err=True)
        raise typer.Exit(1)


def warn_if_unloadable(options, model: str) -> None:
    """One line on stderr when the installed loaders cannot read what is about to be written (of
    this model's family: transformers loads no quantized mixture of experts)."""
    from optkit.compat.matrix import check_installed_versions
    from optkit.modeldir import read_config, resolve_model_dir
    from optkit.quant.formats.kind import ArtifactKind

    w = options.weights
    kind = ArtifactKind(options.format, w.bits, w.symmetric, w8a8=options.activations is not None)
    warning = check_installed_versions(kind, model_type=read_config(resolve_model_dir(model)).get("model_type"))
    if warning:
        typer.echo(f"warning: {warning}", err=True)


def _options(model, flags: dict[str, str], **values):
    """`model(**values)`; a validation error becomes one line naming the flag (`--damp -1.0 is
    invalid: must be ≥ 0`), or the options' own message when no flag sets the field."""
    from pydantic import ValidationError

    from optkit.errors import OptkitError

    try:
        return model(**values)
    except ValidationError as e:
        error = e.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        field = str(error["loc"][0]) if error["loc"] else None
        if field in flags:
            raise OptkitError(f"{flags[field]} {values[field]!r} is invalid: {message}") from None
        where = ".".join(str(p) for p in error["loc"])
        raise OptkitError(f"{where}: {message}" if where else message) from None


class QuantizeCommand(TyperCommand):
    """`optkit quantize --help` lists the registered methods and formats: read from the registries
    when help is asked for (so plug-ins show, and other commands never import them)."""

    def format_help(self, ctx, formatter):
        from optkit.quant import methods
        from optkit.quant.formats import format_names

        for param in self.params:
            if param.name == "method":
                param.help = "Quantization method: " + ", ".join(methods.method_names()) + "."
            if param.name == "format":
                param.help = "Checkpoint format: " + ", ".join(format_names()) + "."
        return super().format_help(ctx, formatter)
