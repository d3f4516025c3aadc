"""`report.html`: a release's metrics with their intervals, the per-layer error and sensitivity
charts (matplotlib PNGs as data URIs) and the gate's statistics pictures (inline SVG,
report_svg.py): per-token KLD distribution, per-window KLD, interval bars. One self-contained
file: no script, nothing fetched."""

import base64
import html
import io

from optkit.gate.report import ROWS
from optkit.pipeline import report_svg


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _per_layer_chart(names: list[str], values: list[float], colors, ylabel: str, title: str) -> str:
    """A bar per layer, named without the `model.layers.` prefix: a base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 3.5))
    axis.bar(range(len(values)), values, color=colors)
    axis.set_xticks(range(len(values)), [n.removeprefix("model.layers.") for n in names], rotation=90, fontsize=7)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    data = _png(figure)
    plt.close(figure)
    return data


def _layer_chart(layers: list[dict]) -> str:
    names, errors = [x["name"] for x in layers], [x["rel_error"] for x in layers]
    return _per_layer_chart(names, errors, "#1f77b4", "relative weight error ‖W−Ŵ‖/‖W‖", "per-layer quantization error")


def _attribution_chart(attribution: dict, raised: dict) -> str:
    """Estimated KLD each linear causes (drop with it in full precision), raised layers in orange."""
    layers = sorted(attribution["layers"], key=lambda x: x["name"])
    colors = ["#ff7f0e" if x["name"] in raised else "#1f77b4" for x in layers]
    names, estimates = [x["name"] for x in layers], [x["estimate"] for x in layers]
    title = "per-layer sensitivity (orange: raised by repair)"
    return _per_layer_chart(names, estimates, colors, "KLD it causes, nats (est.)", title)


def _attribution_section(manifest: dict) -> str:
    attribution = (manifest.get("repair") or {}).get("attribution")
    if not attribution:
        return ""
    chart = _attribution_chart(attribution, manifest.get("precision_overrides") or {})
    return f"""<h2>Per-layer sensitivity</h2>
<p>on {html.escape(attribution["source"])}, {attribution["tokens"]:,} tokens; layers raised by repair:
{len(manifest.get("precision_overrides") or {})}</p>
<img alt="per-layer sensitivity" src="data:image/png;base64,{chart}">
"""


def _interval_rows(gate: dict, checks: dict) -> list[dict]:
    """report_svg.interval_bars' rows: every metric with an interval, in the table's order."""
    intervals = (gate.get("intervals") or {}).get("metrics") or {}
    rows = []
    for metric, label, _ in ROWS:
        found = intervals.get(metric)
        if not found or gate["metrics"].get(metric) is None:
            continue
        check = checks.get(metric)
        limit = check["limit"] if check else None
        upper = check["name"].startswith("max_") if check else True
        rows.append(
            {"label": label, "value": gate["metrics"][metric], "low": found["low"], "high": found["high"]}
            | {"limit": limit, "upper": upper}
        )
    return rows


def _statistics_section(gate: dict, checks: dict) -> str:
    """The gate's pictures: what is there to draw (an older gate.json has no intervals or windows)."""
    parts = []
    if gate.get("kld_histogram"):
        parts.append("<h2>KL divergence per token</h2>\n" + report_svg.kld_distribution(gate["kld_histogram"]))
    if gate.get("window_kld"):
        interval = ((gate.get("intervals") or {}).get("metrics") or {}).get("kld_mean")
        limit = checks["kld_mean"]["limit"] if "kld_mean" in checks else None
        picture = report_svg.window_kld(gate["window_kld"], interval, limit, gate["metrics"].get("kld_mean"))
        parts.append("<h2>KL divergence per window</h2>\n" + picture)
    rows = _interval_rows(gate, checks)
    if rows:
        confidence = gate["intervals"].get("confidence", 0.95)
        method = html.escape(str(gate["intervals"].get("method", "")))
        parts.append(f"<h2>Intervals ({confidence:.0%}; {method})</h2>\n" + report_svg.interval_bars(rows))
    return "\n".join(parts)


def render_report(title: str, manifest: dict, gate: dict, verdict: str) -> str:
    checks = {c["metric"]: c for c in gate["checks"]}
    intervals = (gate.get("intervals") or {}).get("metrics") or {}
    rows = []
    for metric, label, fmt in ROWS:
        if metric not in gate["metrics"]:
            continue
        check = checks.get(metric)
        state = None if check is None else check.get("state") or ("ok" if check["passed"] else "crossed")
        status = {None: "", "ok": "ok", "crossed": "CROSSED", "unsure": "unsure"}[state]
        css = f' class="{state}"' if state in ("crossed", "unsure") else ""
        rule = check["rule"] if check else ""
        found = intervals.get(metric) or {}
        interval = ""
        if found.get("low") is not None and found.get("high") is not None:
            interval = f"[{fmt.format(found['low'])}, {fmt.format(found['high'])}]"
        rows.append(
            f"<tr{css}><td>{label}</td><td>{fmt.format(gate['metrics'][metric])}</td><td>{interval}</td>"
            f"<td>{html.escape(rule)}</td><td>{status}</td></tr>"
        )
    color = {"released": "#1a7f37", "inconclusive": "#9a6700"}.get(verdict, "#cf222e")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}: optkit report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} td,th{{padding:.2em .8em;text-align:left}}
tr.crossed td{{color:#cf222e;font-weight:bold}} tr.unsure td{{color:#9a6700}}
.verdict{{color:{color};font-size:1.4em;font-weight:bold}}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<p class="verdict">{verdict.upper()}</p>
<p>method <b>{html.escape(str(manifest["method"]))}</b>, format {html.escape(str(manifest["format"]))},
base {html.escape(manifest["base_model"]["path"])}; gate on {html.escape(gate["eval_set"]["name"])}
({gate["metrics"]["num_tokens"]:,} tokens).</p>
<table><tr><th>metric</th><th>value</th><th>interval</th><th>threshold</th><th></th></tr>
{chr(10).join(rows)}
</table>
<h2>Per-layer error</h2>
<img alt="per-layer error" src="data:image/png;base64,{_layer_chart(manifest["layers"])}">
{_attribution_section(manifest)}{_statistics_section(gate, checks)}
</body></html>
"""
