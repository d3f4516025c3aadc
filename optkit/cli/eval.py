"""`optkit eval`: the quality gate."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import EvalSet, JsonFlag, SeqLen, Threads, print_json, print_table, require_supported


def eval_(
    artifact: Annotated[str, typer.Argument(help="Quantized artifact directory (or any model).")],
    baseline: Annotated[
        str, typer.Option("--baseline", help="Full-precision base model: directory or reference name.")
    ],
    eval_set: EvalSet = "heldout",
    max_ppl_increase: Annotated[
        float | None, typer.Option(help="Fail if perplexity rises by more than this percent.")
    ] = None,
    max_kld: Annotated[float | None, typer.Option(help="Fail if the mean KL divergence (nats) exceeds this.")] = None,
    min_top1: Annotated[
        float | None, typer.Option(help="Fail if fewer than this percent of tokens keep the base's top token.")
    ] = None,
    task: Annotated[str | None, typer.Option(help="Multiple-choice task (next_line or a .jsonl) for accuracy.")] = None,
    min_recovery: Annotated[
        float | None, typer.Option(help="Fail if task accuracy falls below this fraction of the base's (e.g. 0.95).")
    ] = None,
    seq_len: SeqLen = 256,
    max_windows: Annotated[int | None, typer.Option(help="Evaluate at most this many windows.")] = None,
    reference_cache: Annotated[
        bool, typer.Option(help="Cache the base's top-k log-probs; later gates do not run the base model.")
    ] = False,
    top_k: Annotated[int, typer.Option(help="With --reference-cache: log-probs kept per token.")] = 256,
    report: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
    attribute: Annotated[
        bool, typer.Option("--attribute", help="Also rank the quantized layers by the KLD each causes.")
    ] = False,
    attribute_windows: Annotated[
        int, typer.Option(help="--attribute: windows of held-out calibration text.", min=1)
    ] = 8,
    exact_swaps: Annotated[
        int, typer.Option(help="--attribute: top layers swapped exactly to scale the estimate; -1: all.", min=-1)
    ] = 3,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            help="Run the artifact through optkit's runtime with this KV cache: auto (the model's dtype), "
            "int8 or fp8 (default: transformers, no paged cache)."
        ),
    ] = None,
    decision: Annotated[
        str,
        typer.Option(
            help="point: pass when every estimate is inside its threshold. confident: pass only when every "
            "one-sided bound at --confidence is inside, reject when one is outside (Bonferroni), else "
            "inconclusive (exit 4)."
        ),
    ] = "point",
    confidence: Annotated[
        float, typer.Option(help="Confidence of the intervals shown and of --decision confident's bounds.")
    ] = 0.95,
    bootstrap_seed: Annotated[int, typer.Option(help="Seed of the bootstrap: the same seed, the same report.")] = 0,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Score a pilot of --pilot-windows windows and print what the eval set can resolve per "
            "threshold and the windows each needs; no verdict (exit 0).",
        ),
    ] = False,
    pilot_windows: Annotated[int, typer.Option(help="--plan: windows in the pilot.", min=2)] = 8,
    sequential: Annotated[
        bool,
        typer.Option(
            "--sequential",
            help="Score windows in a random order (--bootstrap-seed) and stop as soon as every threshold "
            "is decided at --confidence (anytime-valid: gate/sequential.py); inconclusive (exit 4) if "
            "the windows run out first.",
        ),
    ] = False,
    compare: Annotated[
        str | None,
        typer.Option(
            "--compare",
            help="A second artifact of the same base: the paired difference ARTIFACT − COMPARE on the same "
            "windows (and task questions), with its interval and p-value.",
        ),
    ] = None,
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
    """
    require_supported(artifact, baseline, runtime=True)
    from optkit.artifacts import check_writable_dir
    from optkit.devices import set_cpu_threads
    from optkit.errors import OptkitError
    from optkit.gate.evaluate import evaluate
    from optkit.gate.options import GateOptions
    from optkit.gate.report import gate_table, plan_table, write_report

    if decision not in ("point", "confident"):
        raise OptkitError(f"unknown --decision {decision!r}: choose point or confident")
    if not 0.5 < confidence < 1:
        raise OptkitError(f"--confidence {confidence:g} is not a probability above 0.5: give e.g. 0.95")
    if plan and all(x is None for x in (max_ppl_increase, max_kld, min_top1, min_recovery)):
        raise OptkitError("--plan plans for thresholds: add --max-kld, --max-ppl-increase, --min-top1 or --task")
    thresholds = (max_ppl_increase, max_kld, min_top1, min_recovery, task)
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
    set_cpu_threads(threads)
    options = GateOptions(
        max_ppl_increase=max_ppl_increase,
        max_kld=max_kld,
        min_top1=min_top1,
        min_recovery=min_recovery,  # given, even as None: no recipe default (0.95 with a task)
        eval_set=eval_set,
        seq_len=seq_len,
        max_windows=max_windows,
        reference_cache=reference_cache,
        top_k=top_k,
        task=task,
        decision=decision,
        confidence=confidence,
        bootstrap_seed=bootstrap_seed,
        sequential=sequential,
    )
    result = evaluate(
        artifact,
        baseline,
        options,
        artifact_model=_paged_model(artifact, kv_cache_dtype, task),
        pilot_windows=pilot_windows if plan else None,
    )
    attribution = None
    if attribute:  # on held-out calibration windows, not the gate's set
        from optkit.gate.attribution import attribute as attribute_layers

        found = attribute_layers(artifact, baseline, windows=attribute_windows, seq_len=seq_len, exact=exact_swaps)
        attribution = found.to_json()
    payload = result.to_json() | ({"attribution": attribution} if attribution else {})
    comparison = None
    if compare is not None:
        other = evaluate(compare, baseline, options, artifact_model=_paged_model(compare, kv_cache_dtype, task))
        comparison = _compare(result, other, confidence, bootstrap_seed)
        payload["compare"] = comparison
    for warning in result.plan.get("warnings", []):
        typer.echo(f"warning: {warning}", err=True)
    if report is not None:
        write_report(result, report, extra={"attribution": attribution} if attribution else None)
    if json_output:
        print_json(payload)
    else:
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
    raise typer.Exit(result.exit_code)


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


def _paged_model(artifact: str, kv_cache_dtype: str | None, task: str | None):
    """--kv-cache-dtype: the artifact run by the runtime (paged attention, that KV cache), fp32."""
    if kv_cache_dtype is None:
        return None
    from optkit.errors import OptkitError

    if kv_cache_dtype not in ("auto", "int8", "fp8"):
        raise OptkitError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}: choose auto, int8 or fp8")
    if task is not None:
        raise OptkitError("--kv-cache-dtype scores perplexity and KLD only: drop --task, or run the task without it")
    from optkit.models.loader import load_runtime_model
    from optkit.models.paged_lm import PagedLM

    return PagedLM(load_runtime_model(artifact, prepare=False), kv_cache_dtype)  # windows: no decode kernel
