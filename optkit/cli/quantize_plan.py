"""`optkit quantize --dry-run`: the plan (quant/plan.py) as tables, or JSON."""

from optkit.cli.options import console, print_json, print_table


def print_plan(model: str, options, json_output: bool) -> None:
    from rich.table import Table

    from optkit.quant.plan import plan_quantization

    plan = plan_quantization(model, options)
    if json_output:
        print_json(plan.to_json())
        return
    out = console()
    out.print(
        f"[bold]{plan.model}[/]: family {plan.family} (model_type {plan.model_type}); "
        f"{plan.method} {plan.scheme}, format {plan.format}; {len(plan.linears)} linears in {len(plan.layers)} layers"
    )
    table = Table(title="Quantized, layer by layer, group after group (each group sees the groups before it quantized)")
    for column in ("layers", "group", "linears", "out × in"):
        table.add_column(column)
    for layers, groups in _runs(plan.layers):
        for i, group in enumerate(groups):
            first = f"{plan.layers.index(layers[0])}" if len(layers) == 1 else _span(plan, layers)
            shapes = sorted({plan.linears[f"{layers[0][0]}.{n}"] for n in group})
            table.add_row(first if i == 0 else "", str(i + 1), _names(group), ", ".join(f"{o}×{n}" for o, n in shapes))
    print_table(table, out)
    kept = Table(title="Kept in full precision")
    for column in ("what", "tensors", "MB", "why"):
        kept.add_column(column, overflow="fold" if column == "why" else None)
    for k in plan.kept:
        kept.add_row(k.what, str(k.count), f"{k.bytes / 2**20:.1f}", k.reason)
    print_table(kept, out)
    if plan.head != "full":
        head_mb = plan.head_bytes / 2**20
        out.print(f"output head: {plan.head}, {head_mb:.1f} MB (a tied head unties: the embedding stays)")
    peak = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.0f} MB" for k, v in plan.peak_bytes.items() if k != "total")
    out.print(
        f"artifact ≈ {plan.artifact_bytes / 2**20:.1f} MB (base {plan.base_bytes / 2**20:.1f} MB, "
        f"{plan.base_bytes / max(plan.artifact_bytes, 1):.2f}× smaller); "
        f"peak memory ≈ {plan.peak_bytes['total'] / 2**20:.0f} MB ({peak})"
    )


def _runs(layers):
    """Consecutive layers with the same groups, merged: [([(prefix, groups), ...], groups), ...]."""
    runs = []
    for layer in layers:
        if runs and runs[-1][1] == layer[1]:
            runs[-1][0].append(layer)
        else:
            runs.append(([layer], layer[1]))
    return runs


def _span(plan, layers) -> str:
    return f"{plan.layers.index(layers[0])}–{plan.layers.index(layers[-1])}"


def _names(group: list[str]) -> str:
    """Experts collapsed: mlp.experts.{0..7}.w1 rather than eight names."""
    if len(group) <= 4:
        return ", ".join(group)
    return f"{group[0]} … {group[-1]} ({len(group)})"
