"""How a gate result reads: a rich table for people, JSON for machines."""

from pathlib import Path

from rich.table import Table

from optkit.gate.evaluate import GateResult
from optkit.json_strict import dumps

ROWS = [  # (metric, label, format)
    ("ppl_artifact", "perplexity (artifact)", "{:.3f}"),
    ("ppl_base", "perplexity (base)", "{:.3f}"),
    ("ppl_increase_pct", "perplexity increase %", "{:+.3f}"),
    ("kld_mean", "KL divergence, mean", "{:.5f}"),
    ("kld_median", "KL divergence, median", "{:.5f}"),
    ("kld_p95", "KL divergence, p95", "{:.5f}"),
    ("kld_p99", "KL divergence, p99", "{:.5f}"),
    ("kld_max", "KL divergence, max", "{:.5f}"),
    ("top1_pct", "same top token %", "{:.2f}"),
    ("task_acc_base", "task accuracy (base)", "{:.3f}"),
    ("task_acc_artifact", "task accuracy (artifact)", "{:.3f}"),
    ("task_recovery", "task recovery", "{:.3f}"),
]


VERDICTS = {
    "pass": "[bold green]PASS[/]",
    "fail": "[bold red]FAIL[/]",
    "inconclusive": "[bold yellow]INCONCLUSIVE[/]",
    "report_only": "[bold]REPORT ONLY[/] (no threshold set)",
}
STATES = {"ok": "[green]ok[/]", "crossed": "[bold red]crossed[/]", "unsure": "[yellow]unsure[/]"}


def interval_text(result_json: dict, metric: str, fmt: str) -> str:
    """The metric's interval as "[low, high]", or "" when it has none."""
    found = (result_json.get("intervals") or {}).get("metrics", {}).get(metric)
    if not found or found["low"] is None or found["high"] is None:
        return ""
    return f"[{fmt.format(found['low'])}, {fmt.format(found['high'])}]"


def verdict_line(result: GateResult) -> str:
    """What follows "optkit gate:" (rich markup): the verdict and, when inconclusive, what decides it."""
    pilot = result.eval_set.get("pilot_of")
    if pilot is not None:
        return f"[bold]PLAN[/] (a pilot of {result.eval_set['windows']} of {pilot} windows, no verdict)"
    text = VERDICTS[result.verdict]
    decision = result.to_json().get("decision") or {}
    if result.verdict == "inconclusive":
        more = []
        if decision.get("extra_windows"):
            more.append(f"~{decision['extra_windows']} more windows")
        if decision.get("extra_items"):
            more.append(f"~{decision['extra_items']} more task questions")
        text += f" ({' and '.join(more) or 'no number of windows'} would decide it if the estimates hold)"
    return text


def engine_line(engine: dict) -> str | None:
    """What ran the artifact, e.g. "engine: vllm 0.32.0, bfloat16" (None: not said)."""
    if not engine:
        return None
    text = f"engine: {engine['name']}" + (f" {engine['vllm']}" if engine.get("vllm") else "")
    if engine.get("dtype"):
        text += f", {engine['dtype']}"
    if engine.get("kv_cache_dtype") not in (None, "auto"):
        text += f", KV cache {engine['kv_cache_dtype']}"
    return text


def gate_table(result: GateResult) -> Table:
    report = result.to_json()
    checks = {c.metric: c for c in result.checks}
    # the bound column: the confident rule's one-sided bounds (--sequential's bets have none)
    confident = result.decision is not None and result.decision.rule == "confident" and not result.sequential
    confidence = (report.get("intervals") or {}).get("confidence", 0.95)
    table = Table(
        title=f"optkit gate: {verdict_line(result)}  "
        f"({result.metrics['num_tokens']:,} tokens of {result.eval_set['name']})",
        caption=engine_line(result.engine),
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column(f"{confidence:.0%} interval", justify="right")
    table.add_column("threshold", justify="right")
    if confident:
        table.add_column(f"{confidence:.0%} bound", justify="right")
    table.add_column("", justify="center")
    for metric, label, fmt in ROWS:
        if metric not in result.metrics:
            continue
        cells = [label, fmt.format(result.metrics[metric]), interval_text(report, metric, fmt)]
        c = checks.get(metric)
        bound = "" if c is None or c.bound is None else fmt.format(c.bound)
        cells += ["", bound, ""] if c is None else [c.rule, bound, STATES[c.state]]
        if not confident:
            del cells[4]
        if c is not None and c.state == "crossed":
            cells[:-1] = [f"[red]{cell}[/]" for cell in cells[:-1]]
        table.add_row(*cells)
    return table


def plan_table(plan: dict) -> Table:
    """What the eval set can resolve per threshold (gate/power.py)."""
    table = Table(title=f"plan: {plan['confidence']:.0%} confidence, {plan['power']:.0%} power")
    columns = (
        "threshold",
        "estimate",
        "sd per unit",
        "units",
        "margin to pass",
        "margin to reject",
        "units for the threshold",
        "units for this one",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "threshold" else "right")
    for metric in plan["metrics"].values():
        needed, this_one = metric["units_for_threshold"], metric["units_for_this_artifact"]
        table.add_row(
            f"{metric['threshold']} {metric['limit']:g}",
            f"{metric['estimate']:.5g}",
            f"{metric['sd_per_unit']:.3g}",
            f"{metric['eval_units']} {metric['unit']}",
            f"{metric['margin_to_pass']:.3g}",
            f"{metric['margin_to_reject']:.3g}",
            "" if needed is None else f"{needed}",
            "on the line" if this_one is None else f"{this_one}",
        )
    return table


def write_report(result: GateResult, path: Path, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(dumps(result.to_json() | (extra or {}), indent=2) + "\n")
    tmp.replace(path)


def attribution_table(attribution: dict, limit: int | None = 20) -> Table:
    """The layers that cause the most KLD, from `Attribution.to_json()`: estimated drop of the mean
    KLD with the layer in full precision (and at 8 bits), its share, and the exact swap where run."""
    exact = attribution["exact_swaps"]
    caption = f"estimate scaled by {exact} exact swap{'s' if exact != 1 else ''} (×{attribution['scale']:.3f})"
    if attribution.get("spearman") is not None:
        caption += f"; Spearman vs exact swaps {attribution['spearman']:.3f}"
    table = Table(
        title=f"per-layer sensitivity: KLD {attribution['kld']:.5f} on {attribution['tokens']:,} tokens "
        f"of {attribution['source']}",
        caption=caption,
    )
    for column in ("#", "layer", "KLD drop, full precision", "share %", "KLD drop, 8 bits", "exact swap"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    layers = attribution["layers"] if limit is None else attribution["layers"][:limit]
    for rank, layer in enumerate(layers, 1):
        eight = layer.get("estimate_8bit")
        table.add_row(
            str(rank),
            layer["name"],
            f"{layer['estimate']:.5f}",
            f"{100 * layer['share']:.1f}",
            "" if eight is None else f"{eight:.5f}",
            "" if layer.get("exact") is None else f"{layer['exact']:.5f}",
        )
    return table
