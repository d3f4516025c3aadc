"""`report.html`: a release's metrics, per-layer error chart and KL-divergence histogram, one
self-contained file (the charts are matplotlib PNGs embedded as data URIs)."""

import base64
import html
import io
from itertools import pairwise

from optkit.gate.report import ROWS


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _layer_chart(layers: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 3.5))
    names = [layer["name"].removeprefix("model.layers.") for layer in layers]
    axis.bar(range(len(layers)), [layer["rel_error"] for layer in layers], color="#1f77b4")
    axis.set_xticks(range(len(layers)), names, rotation=90, fontsize=7)
    axis.set_ylabel("relative weight error ‖W−Ŵ‖/‖W‖")
    axis.set_title("per-layer quantization error")
    data = _png(figure)
    plt.close(figure)
    return data


def _attribution_chart(attribution: dict, raised: dict) -> str:
    """Estimated KLD each linear causes (drop with it in full precision), raised layers in orange."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    layers = sorted(attribution["layers"], key=lambda x: x["name"])
    figure, axis = plt.subplots(figsize=(10, 3.5))
    colors = ["#ff7f0e" if x["name"] in raised else "#1f77b4" for x in layers]
    axis.bar(range(len(layers)), [x["estimate"] for x in layers], color=colors)
    names = [x["name"].removeprefix("model.layers.") for x in layers]
    axis.set_xticks(range(len(layers)), names, rotation=90, fontsize=7)
    axis.set_ylabel("KLD it causes, nats (est.)")
    axis.set_title("per-layer sensitivity (orange: raised by repair)")
    data = _png(figure)
    plt.close(figure)
    return data


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


def _kld_chart(histogram: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    edges, counts = histogram["edges"], histogram["counts"]
    labels = [f"<{edges[1]:g}"] + [f"{lo:g}–{hi:g}" for lo, hi in pairwise(edges[1:])] + [f"≥{edges[-1]:g}"]
    figure, axis = plt.subplots(figsize=(10, 3.5))
    axis.bar(range(len(counts)), counts, color="#1f77b4")
    axis.set_xticks(range(len(counts)), labels[: len(counts)], fontsize=8)
    axis.set_yscale("log")
    axis.set_xlabel("KL(P_base ‖ P_artifact) per token, nats")
    axis.set_ylabel("tokens")
    axis.set_title("KL divergence histogram")
    data = _png(figure)
    plt.close(figure)
    return data


def render_report(title: str, manifest: dict, gate: dict, verdict: str) -> str:
    checks = {c["metric"]: c for c in gate["checks"]}
    rows = []
    for metric, label, fmt in ROWS:
        if metric not in gate["metrics"]:
            continue
        check = checks.get(metric)
        status = "" if check is None else ("ok" if check["passed"] else "CROSSED")
        css = ' class="crossed"' if check is not None and not check["passed"] else ""
        rule = check["rule"] if check else ""
        rows.append(
            f"<tr{css}><td>{label}</td><td>{fmt.format(gate['metrics'][metric])}</td>"
            f"<td>{html.escape(rule)}</td><td>{status}</td></tr>"
        )
    color = "#1a7f37" if verdict == "released" else "#cf222e"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}: optkit report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} td,th{{padding:.2em .8em;text-align:left}}
tr.crossed td{{color:#cf222e;font-weight:bold}} .verdict{{color:{color};font-size:1.4em;font-weight:bold}}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<p class="verdict">{verdict.upper()}</p>
<p>method <b>{html.escape(str(manifest["method"]))}</b>, format {html.escape(str(manifest["format"]))},
base {html.escape(manifest["base_model"]["path"])}; gate on {html.escape(gate["eval_set"]["name"])}
({gate["metrics"]["num_tokens"]:,} tokens).</p>
<table><tr><th>metric</th><th>value</th><th>threshold</th><th></th></tr>
{chr(10).join(rows)}
</table>
<h2>Per-layer error</h2>
<img alt="per-layer error" src="data:image/png;base64,{_layer_chart(manifest["layers"])}">
{_attribution_section(manifest)}<h2>KL divergence</h2>
<img alt="KL divergence histogram" src="data:image/png;base64,{_kld_chart(gate["kld_histogram"])}">
</body></html>
"""
