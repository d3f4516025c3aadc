"""report.html's statistics pictures as plain inline SVG (no script, nothing fetched): the per-token
KLD distribution (log-scale histogram and its CDF), each window's mean KLD against the interval
and the threshold, and each metric's interval against its threshold. Each function takes the gate
report's JSON parts and returns one <svg> element."""

import html
import math

WIDTH, HEIGHT, MARGIN = 900, 260, 56
BLUE, RED, ORANGE, GREEN, GREY = "#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#888888"


def _svg(label: str, body: list[str], height: int = HEIGHT) -> str:
    title = html.escape(label)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{title}" width="{WIDTH}" '
        f'height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">'
        f"<title>{title}</title>" + "".join(body) + "</svg>"
    )


def _text(x: float, y: float, text: str, anchor: str = "middle", **attrs) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{html.escape(text)}</text>'


def _line(x1: float, y1: float, x2: float, y2: float, color: str, width: float = 1, dash: str = "") -> str:
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    ends = f'x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"'
    return f'<line {ends} stroke="{color}" stroke-width="{width}"{dashed}/>'


def _label(edge: float) -> str:
    return "0" if edge == 0 else f"1e{round(math.log10(edge))}"


def kld_distribution(histogram: dict) -> str:
    """Tokens per KLD bin (bars, log-scale count) and the share of tokens at or below each edge
    (the CDF, red, right axis); the x axis is the bins in order: log-spaced edges from 1e-6 nats."""
    edges, counts = histogram["edges"], histogram["counts"]
    total = max(sum(counts), 1)
    left, right, top, bottom = MARGIN, WIDTH - MARGIN, 20, HEIGHT - 40
    step = (right - left) / len(counts)
    peak = math.log10(max(max(counts), 1)) + 1
    body = [_line(left, bottom, right, bottom, GREY), _line(left, top, left, bottom, GREY)]
    for i, count in enumerate(counts):
        if count:
            height = (math.log10(count) + 1) / peak * (bottom - top)
            body.append(
                f'<rect class="bin" x="{left + i * step + 1:.1f}" y="{bottom - height:.1f}" '
                f'width="{max(step - 2, 1):.1f}" height="{height:.1f}" fill="{BLUE}"/>'
            )
    cumulative, points = 0, []
    for i, count in enumerate(counts):
        cumulative += count
        points.append(f"{left + (i + 1) * step:.1f},{bottom - cumulative / total * (bottom - top):.1f}")
    body.append(f'<polyline class="cdf" points="{" ".join(points)}" fill="none" stroke="{RED}" stroke-width="2"/>')
    for i, edge in enumerate(edges):
        if edge == 0 or abs(math.log10(edge) - round(math.log10(edge))) < 1e-9:
            body.append(_text(left + i * step, bottom + 14, _label(edge)))
    for share in (0, 0.5, 1):
        body.append(_text(right + 6, bottom - share * (bottom - top) + 4, f"{share:.0%}", "start", fill=RED))
    for power in range(int(peak)):
        body.append(_text(left - 6, bottom - (power + 1) / peak * (bottom - top) + 4, f"{10**power:,}", "end"))
    body.append(_text((left + right) / 2, HEIGHT - 8, "KL(P_base ‖ P_artifact) per token, nats (log scale)"))
    return _svg("per-token KL divergence: tokens per bin (log scale) and cumulative share", body)


def window_kld(values: list[float], interval: dict | None, limit: float | None, mean: float | None) -> str:
    """Each window's mean KLD in the order evaluated (dots), the mean KLD's interval (band), the
    mean (line) and the threshold (dashed orange)."""
    left, right, top, bottom = MARGIN + 20, WIDTH - MARGIN, 20, HEIGHT - 40
    high = max([*values, limit or 0, (interval or {}).get("high") or 0]) * 1.1 or 1.0
    step = (right - left) / max(len(values), 1)

    def y(v: float) -> float:
        return bottom - v / high * (bottom - top)

    body = [_line(left, bottom, right, bottom, GREY), _line(left, top, left, bottom, GREY)]
    if interval and interval.get("low") is not None and interval.get("high") is not None:
        body.append(
            f'<rect class="interval" x="{left}" y="{y(interval["high"]):.1f}" width="{right - left}" '
            f'height="{max(y(interval["low"]) - y(interval["high"]), 1):.1f}" fill="{BLUE}" fill-opacity="0.18"/>'
        )
    if mean is not None:
        body.append(_line(left, y(mean), right, y(mean), BLUE, 1.5))
    if limit is not None:
        body.append(_line(left, y(limit), right, y(limit), ORANGE, 2, "6 4"))
        body.append(_text(right, y(limit) - 4, f"threshold {limit:g}", "end", fill=ORANGE))
    radius = max(1.5, min(4.0, step / 2.5))
    for i, value in enumerate(values):
        centre = f'cx="{left + (i + 0.5) * step:.1f}" cy="{y(value):.1f}"'
        body.append(f'<circle class="window" {centre} r="{radius:.1f}" fill="{GREEN}"/>')
    for share in (0, 0.5, 1):
        body.append(_text(left - 6, y(share * high) + 4, f"{share * high:.2g}", "end"))
    body.append(_text((left + right) / 2, HEIGHT - 8, f"window, in the order evaluated ({len(values)})"))
    return _svg("mean KL divergence of each window against the interval and the threshold", body)


def interval_bars(rows: list[dict]) -> str:
    """One row per metric: its interval (bar), estimate (dot) and threshold (tick, green when the
    interval is inside, red when outside, orange when it straddles). rows: {label, value, low, high,
    limit (or None), upper (True: the metric must stay at or below the limit)}."""
    row_height, left, right = 34, 250, WIDTH - 90
    height = 24 + row_height * len(rows)
    body = []
    for i, row in enumerate(rows):
        y = 20 + i * row_height + row_height / 2
        points = [v for v in (row["value"], row["low"], row["high"], row["limit"]) if v is not None]
        lo, hi = min(points), max(points)
        pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad

        def x(v: float, lo=lo, hi=hi) -> float:
            return left + (v - lo) / (hi - lo) * (right - left)

        body.append(_text(left - 10, y + 4, row["label"], "end"))
        body.append(_line(left, y, right, y, "#dddddd"))
        if row["low"] is not None and row["high"] is not None:
            body.append(
                f'<rect class="bar" x="{x(row["low"]):.1f}" y="{y - 6:.1f}" '
                f'width="{max(x(row["high"]) - x(row["low"]), 2):.1f}" height="12" fill="{BLUE}" fill-opacity="0.5"/>'
            )
        body.append(f'<circle cx="{x(row["value"]):.1f}" cy="{y:.1f}" r="4" fill="{BLUE}"/>')
        if row["limit"] is not None:
            color = _limit_color(row)
            body.append(_line(x(row["limit"]), y - 12, x(row["limit"]), y + 12, color, 3))
            body.append(
                _text(right + 8, y + 4, f"{'≤' if row['upper'] else '≥'} {row['limit']:g}", "start", fill=color)
            )
        low, high = (f"{v:.4g}" if v is not None else "?" for v in (row["low"], row["high"]))
        body.append(_text(x(row["value"]), y - 9, f"{row['value']:.4g} [{low}, {high}]", font_size="9"))
    return _svg("each metric's interval against its threshold", body, height)


def _limit_color(row: dict) -> str:
    low, high, limit = row["low"], row["high"], row["limit"]
    if low is None or high is None:
        return ORANGE
    inside = high <= limit if row["upper"] else low >= limit
    outside = low > limit if row["upper"] else high < limit
    return GREEN if inside else RED if outside else ORANGE
