"""`optkit eval`: the quality gate."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import EvalSet, JsonFlag, SeqLen, Threads, print_json, print_table, require_supported

# ---------------------------------------------------------------- the flags
Artifact = Annotated[str, typer.Argument(help="Quantized artifact directory (or any model).")]
Baseline = Annotated[str, typer.Option("--baseline", help="Full-precision base model: directory or reference name.")]
MaxPplIncrease = Annotated[float | None, typer.Option(help="Fail if perplexity rises by more than this percent.")]
MaxKld = Annotated[float | None, typer.Option(help="Fail if the mean KL divergence (nats) exceeds this.")]
MinTop1 = Annotated[
    float | None, typer.Option(help="Fail if fewer than this percent of tokens keep the base's top token.")
]
Task = Annotated[str | None, typer.Option(help="Multiple-choice task (next_line or a .jsonl) for accuracy.")]
MinRecovery = Annotated[
    float | None, typer.Option(help="Fail if task accuracy falls below this fraction of the base's (e.g. 0.95).")
]
MaxWindows = Annotated[int | None, typer.Option(help="Evaluate at most this many windows.")]
ReferenceCache = Annotated[
    bool, typer.Option(help="Cache the base's top-k log-probs; later gates do not run the base model.")
]
TopK = Annotated[int, typer.Option(help="With --reference-cache: log-probs kept per token.")]
Report = Annotated[Path | None, typer.Option(help="Write the JSON report here.")]
Attribute = Annotated[bool, typer.Option("--attribute", help="Also rank the quantized layers by the KLD each causes.")]
AttributeWindows = Annotated[int, typer.Option(help="--attribute: windows of held-out calibration text.", min=1)]
ExactSwaps = Annotated[
    int, typer.Option(help="--attribute: top layers swapped exactly to scale the estimate; -1: all.", min=-1)
]
Engine = Annotated[
    str | None,
    typer.Option(
        help="What runs the artifact: transformers (a directory's default), optkit (the runtime's paged "
        "attention), vllm (vLLM's kernels in its own venv: --vllm-python) or llama.cpp (a .gguf's, and "
        "only engine)."
    ),
]
VllmPython = Annotated[
    str | None,
    typer.Option(
        help="--engine vllm: the python of vLLM's venv (default: $OPTKIT_VLLM_PYTHON; `make vllm` builds one)."
    ),
]
KvCacheDtype = Annotated[
    str | None,
    typer.Option(
        help="The KV cache of --engine optkit (implied when --engine is not given) or vllm: auto (the model's "
        "dtype), int8 (optkit only) or fp8."
    ),
]
DecisionRule = Annotated[
    str,
    typer.Option(
        "--decision",
        help="point: pass when every estimate is inside its threshold. confident: pass only when every "
        "one-sided bound at --confidence is inside, reject when one is outside (Bonferroni), else "
        "inconclusive (exit 4).",
    ),
]
Confidence = Annotated[
    float, typer.Option(help="Confidence of the intervals shown and of --decision confident's bounds.")
]
BootstrapSeed = Annotated[int, typer.Option(help="Seed of the bootstrap: the same seed, the same report.")]
Plan = Annotated[
    bool,
    typer.Option(
        "--plan",
        help="Score a pilot of --pilot-windows windows and print what the eval set can resolve per "
        "threshold and the windows each needs; no verdict (exit 0).",
    ),
]
PilotWindows = Annotated[int, typer.Option(help="--plan: windows in the pilot.", min=2)]
Sequential = Annotated[
    bool,
    typer.Option(
        "--sequential",
        help="Score windows in a random order (--bootstrap-seed) and stop as soon as every threshold "
        "is decided at --confidence (anytime-valid: gate/sequential.py); inconclusive (exit 4) if "
        "the windows run out first.",
    ),
]
Compare = Annotated[
    str | None,
    typer.Option(
        "--compare",
        help="A second artifact of the same base: the paired difference ARTIFACT − COMPARE on the same "
        "windows (and task questions), with its interval and p-value.",
    ),
]


def eval_(
    artifact: Artifact,
    baseline: Baseline,
    eval_set: EvalSet = "heldout",
    max_ppl_increase: MaxPplIncrease = None,
    max_kld: MaxKld = None,
    min_top1: MinTop1 = None,
    task: Task = None,
    min_recovery: MinRecovery = None,
    seq_len: SeqLen = 256,
    max_windows: MaxWindows = None,
    reference_cache: ReferenceCache = False,
    top_k: TopK = 256,
    report: Report = None,
    attribute: Attribute = False,
    attribute_windows: AttributeWindows = 8,
    exact_swaps: ExactSwaps = 3,
    engine: Engine = None,
    vllm_python: VllmPython = None,
    kv_cache_dtype: KvCacheDtype = None,
    decision: DecisionRule = "point",
    confidence: Confidence = 0.95,
    bootstrap_seed: BootstrapSeed = 0,
    plan: Plan = False,
    pilot_windows: PilotWindows = 8,
    sequential: Sequential = False,
    compare: Compare = None,
    threads: Threads = None,
    json_output: JsonFlag = False,
) -> None:
    """Compare an artifact with its full-precision base, with a confidence interval per metric.

    With no threshold the gate only reports (REPORT ONLY, exit 0): it never says PASS unasked.

    Exit codes: 0 every threshold holds (or no threshold: report only), 1 rejected: a threshold is
    crossed, 2 bad input or an unusable file, 3 a bug in optkit, 4 inconclusive (--decision
    confident: the eval set cannot tell; the report says how many more windows would decide it if
    its estimates hold).

    Example: optkit eval out/small-w4 --baseline small --max-ppl-increase 1 --max-kld 0.01 --min-top1 90

    Example: optkit eval out/small-w4 --baseline small --max-kld 0.01 --decision confident

    Example: optkit eval out/small-w4 --baseline small --max-kld 0.01 --plan  (how many windows it needs)

    Example: optkit eval out/small-w4 --baseline small --max-kld 0.01 --sequential  (stop once decided)

    Example: optkit eval out/small-gptq --compare out/small-rtn --baseline small  (is GPTQ better?)

    Example: optkit eval out/small-w4 --baseline small --attribute  (which layers cause the KLD)

    Example: optkit eval out/small-w4 --baseline small --engine vllm --vllm-python .venv-vllm/bin/python
    """
    require_supported(artifact, baseline, runtime=True)
    from optkit.devices import set_cpu_threads

    settings = {
        "eval_set": eval_set,
        "seq_len": seq_len,
        "max_windows": max_windows,
        "reference_cache": reference_cache,
        "top_k": top_k,
        "decision": decision,
        "confidence": confidence,
        "bootstrap_seed": bootstrap_seed,
        "sequential": sequential,
    }
    thresholds = (max_ppl_increase, max_kld, min_top1, min_recovery, task)
    options = _gate_options(thresholds, settings, plan=plan, compare=compare, report=report)
    set_cpu_threads(threads)
    runs = {"engine": engine, "kv_cache_dtype": kv_cache_dtype, "vllm_python": vllm_python}
    result = _gate(artifact, baseline, options, runs, pilot_windows=pilot_windows if plan else None)
    extra = {}  # what the report and --json carry beside the gate's result
    if attribute:  # on held-out calibration windows, not the gate's set
        extra["attribution"] = _attribution(artifact, baseline, attribute_windows, seq_len, exact_swaps)
    if compare is not None:
        extra["compare"] = _compare(result, _gate(compare, baseline, options, runs), confidence, bootstrap_seed)
    _show(result, extra, report, json_output, artifact, compare)
    raise typer.Exit(result.exit_code)


def _gate_options(thresholds: tuple, settings: dict, *, plan: bool, compare: str | None, report: Path | None):
    """The gate's options, after refusing the flags that contradict each other or cannot work."""
    from optkit.artifacts import check_writable_dir
    from optkit.errors import OptkitError
    from optkit.gate.options import GateOptions

    max_ppl_increase, max_kld, min_top1, min_recovery, task = thresholds
    decision, confidence, sequential = settings["decision"], settings["confidence"], settings["sequential"]
    if decision not in ("point", "confident"):
        raise OptkitError(f"unknown --decision {decision!r}: choose point or confident")
    if not 0.5 < confidence < 1:
        raise OptkitError(f"--confidence {confidence:g} is not a probability above 0.5: give e.g. 0.95")
    if plan and all(x is None for x in (max_ppl_increase, max_kld, min_top1, min_recovery)):
        raise OptkitError("--plan plans for thresholds: add --max-kld, --max-ppl-increase, --min-top1 or --task")
    if sequential and all(x is None for x in thresholds):
        raise OptkitError("--sequential stops once the thresholds are decided: add --max-kld (or another threshold)")
    if sequential and (plan or compare):
        raise OptkitError(f"--sequential scores a varying number of windows: drop {'--plan' if plan else '--compare'}")
    if min_recovery is not None and task is None:
        raise OptkitError("--min-recovery needs a task: add --task next_line (or a .jsonl task)")
    if report is not None:  # before the gate runs, not after
        if report.is_dir():
            raise OptkitError(f"--report {report} is a directory: give a file name such as {report / 'gate.json'}")
        check_writable_dir(report.parent, "--report", named=report)
    return GateOptions(
        max_ppl_increase=max_ppl_increase,
        max_kld=max_kld,
        min_top1=min_top1,
        min_recovery=min_recovery,  # given, even as None: no recipe default (0.95 with a task)
        task=task,
        **settings,
    )


def _gate(artifact: str, baseline: str, options, runs: dict, pilot_windows: int | None = None):
    """evaluate() with the artifact run by the engine --engine (and --kv-cache-dtype) choose."""
    from optkit.gate.evaluate import evaluate
    from optkit.pipeline.gate_engine import gate_engine

    engine = gate_engine(
        artifact,
        runs["engine"],
        kv_cache_dtype=runs["kv_cache_dtype"],
        task=options.task,
        seq_len=options.seq_len,
        vllm_python=runs["vllm_python"],
    )
    with engine as (model, described):
        return evaluate(
            artifact, baseline, options, artifact_model=model, engine=described, pilot_windows=pilot_windows
        )


def _show(result, extra: dict, report: Path | None, json_output: bool, artifact: str, compare: str | None) -> None:
    """Warnings on stderr, the report file (with the attribution), then tables or --json on stdout."""
    from optkit.gate.report import gate_table, plan_table, write_report

    attribution, comparison = extra.get("attribution"), extra.get("compare")
    for warning in result.plan.get("warnings", []):
        typer.echo(f"warning: {warning}", err=True)
    if report is not None:
        write_report(result, report, extra={"attribution": attribution} if attribution else None)
    if json_output:
        print_json(result.to_json() | extra)
        return
    print_table(gate_table(result))
    if result.sequential:
        typer.echo(_sequential_line(result.sequential, result.decision.reason))
    if result.plan.get("metrics"):
        print_table(plan_table(result.plan))
    if attribution:
        from optkit.gate.report import attribution_table

        print_table(attribution_table(attribution))
    if comparison is not None:
        from optkit.gate.compare import comparison_table

        print_table(comparison_table(comparison, artifact, compare))


def _attribution(artifact: str, baseline: str, windows: int, seq_len: int, exact_swaps: int) -> dict:
    """--attribute: the quantized layers ranked by the KLD each causes."""
    from optkit.gate.attribution import attribute

    return attribute(artifact, baseline, windows=windows, seq_len=seq_len, exact=exact_swaps).to_json()


def _sequential_line(bets: dict, reason: str) -> str:
    """How many windows --sequential scored of those it could have, and why it stopped."""
    return f"{reason} (of {bets['windows_available']} windows; error rate {bets['alpha']:g} per verdict)"


def _compare(result, other, confidence: float, seed: int) -> dict:
    """--compare: ARTIFACT − COMPARE on the windows (and questions) both were scored on."""
    from optkit.gate.compare import compare_items, compare_windows, to_json

    differences = compare_windows(result.windows, other.windows, confidence=confidence, seed=seed)
    if result.answers is not None and other.answers is not None:
        differences.append(compare_items(result.answers[1], other.answers[1], confidence=confidence, seed=seed))
    return to_json(differences, confidence) | {"artifact": result.artifact, "compare": other.artifact}
