"""How a gate result reads: a rich table for people, JSON for machines."""

import json
from pathlib import Path

from rich.table import Table

from optkit.gate.evaluate import GateResult

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


def gate_table(result: GateResult) -> Table:
    checks = {c.metric: c for c in result.checks}
    verdict = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
    table = Table(
        title=f"optkit gate: {verdict}  ({result.metrics['num_tokens']:,} tokens of {result.eval_set['name']})"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("threshold", justify="right")
    table.add_column("", justify="center")
    for metric, label, fmt in ROWS:
        if metric not in result.metrics:
            continue
        value = fmt.format(result.metrics[metric])
        c = checks.get(metric)
        if c is None:
            table.add_row(label, value, "", "")
        elif c.passed:
            table.add_row(label, value, c.rule, "[green]ok[/]")
        else:
            table.add_row(f"[red]{label}[/]", f"[red]{value}[/]", f"[red]{c.rule}[/]", "[bold red]crossed[/]")
    return table


def write_report(result: GateResult, path: Path, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result.to_json() | (extra or {}), indent=2) + "\n")
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
