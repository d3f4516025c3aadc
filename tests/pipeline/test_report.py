"""report.html renders in headless Chromium with its charts (Chromium: Debian's `chromium`), and
its statistics pictures (inline SVG) draw what the gate measured."""

import base64
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import matplotlib.image
import numpy as np

from optkit.pipeline.report_html import render_report
from tests.pipeline.test_run import write_recipe

SVG = "{http://www.w3.org/2000/svg}"

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_report_html_renders_with_its_charts(run_cli, tmp_path, draft_dir):
    code, _, err = run_cli("run", write_recipe(tmp_path, draft_dir))
    assert code == 0, err
    report = tmp_path / "release" / "report.html"
    page = report.read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [alt for alt, _ in images] == ["per-layer error"]
    for _, data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG")
    gate = json.loads((tmp_path / "release" / "gate.json").read_text())
    pictures = {svg.get("aria-label"): svg for svg in map(ET.fromstring, re.findall(r"<svg .*?</svg>", page, re.S))}
    assert len(pictures) == 3 and "<script" not in page and "http" not in page.replace(SVG[1:-1], "")
    windows = pictures["mean KL divergence of each window against the interval and the threshold"]
    assert len(windows.findall(f"{SVG}circle")) == len(gate["window_kld"]) == gate["eval_set"]["windows"]

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "install Debian's chromium (make install does where apt-get is available)"
    screenshot = tmp_path / "report.png"
    subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={screenshot}",
            "--window-size=1200,2600",
            report.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = matplotlib.image.imread(screenshot)[..., :3]
    for name, rgb, least in (("bars", (0x1F, 0x77, 0xB4), 2000), ("windows", (0x2C, 0xA0, 0x2C), 100)):
        shown = (np.abs(pixels - np.array(rgb) / 255).max(axis=-1) < 0.03).sum()
        assert shown > least, f"the {name} did not render"
    cdf_red = (np.abs(pixels - np.array([0xD6, 0x27, 0x28]) / 255).max(axis=-1) < 0.03).sum()
    assert cdf_red > 200, "the KLD distribution's CDF did not render"


def _gate(kld_mean: float, low: float, high: float, limit: float) -> dict:
    counts = [0] * 30
    counts[3], counts[12], counts[13], counts[20] = 5, 400, 900, 3
    return {
        "eval_set": {"name": "heldout"},
        "metrics": {"num_tokens": 1308, "kld_mean": kld_mean, "top1_pct": 95.0, "ppl_increase_pct": 0.8},
        "intervals": {
            "confidence": 0.95,
            "method": "paired bootstrap-t",
            "metrics": {
                "kld_mean": {"low": low, "high": high, "units": 4},
                "top1_pct": {"low": 94.0, "high": 96.0, "units": 4},
                "ppl_increase_pct": {"low": 0.4, "high": 1.2, "units": 4},
            },
        },
        "checks": [
            {"name": "max_kld", "metric": "kld_mean", "value": kld_mean, "limit": limit, "passed": high <= limit}
            | {"rule": f"≤ {limit:g}"},
            {"name": "min_top1", "metric": "top1_pct", "value": 95.0, "limit": 90.0, "passed": True, "rule": "≥ 90"},
        ],
        "kld_histogram": {"edges": [0.0] + [10.0 ** (e / 4) for e in range(-24, 5)], "counts": counts},
        "window_kld": [0.004, 0.005, 0.0045, 0.006],
    }


def _pictures(gate: dict) -> dict:
    manifest = {"method": "rtn", "format": "compressed-tensors", "base_model": {"path": "small"}, "layers": []}
    page = render_report("small-w4", manifest, gate, "released")
    return {svg.get("aria-label"): svg for svg in map(ET.fromstring, re.findall(r"<svg .*?</svg>", page, re.S))}


def test_the_pictures_draw_every_bin_window_and_interval_and_colour_the_threshold_by_the_interval():
    pictures = _pictures(_gate(0.005, 0.004, 0.006, 0.01))
    distribution = pictures["per-token KL divergence: tokens per bin (log scale) and cumulative share"]
    assert len(distribution.findall(f"{SVG}rect[@class='bin']")) == 4  # the non-empty bins
    cdf = distribution.find(f"{SVG}polyline[@class='cdf']").get("points").split()
    assert len(cdf) == 30 and float(cdf[-1].split(",")[1]) < float(cdf[0].split(",")[1])  # rises to 100%
    windows = pictures["mean KL divergence of each window against the interval and the threshold"]
    assert len(windows.findall(f"{SVG}circle[@class='window']")) == 4
    assert len(windows.findall(f"{SVG}rect[@class='interval']")) == 1
    bars = pictures["each metric's interval against its threshold"]
    assert len(bars.findall(f"{SVG}rect[@class='bar']")) == 3  # Δppl, KLD, top-1
    ticks = [line.get("stroke") for line in bars.findall(f"{SVG}line") if line.get("stroke-width") == "3"]
    assert ticks == ["#2ca02c", "#2ca02c"]  # both intervals inside their thresholds
    straddling = _pictures(_gate(0.009, 0.008, 0.011, 0.01))["each metric's interval against its threshold"]
    ticks = [line.get("stroke") for line in straddling.findall(f"{SVG}line") if line.get("stroke-width") == "3"]
    assert ticks[0] == "#ff7f0e"  # the KLD interval holds the threshold: undecided


def test_an_older_gate_report_without_intervals_or_windows_still_renders():
    gate = _gate(0.005, 0.004, 0.006, 0.01)
    del gate["intervals"], gate["window_kld"]
    pictures = _pictures(gate)
    assert list(pictures) == ["per-token KL divergence: tokens per bin (log scale) and cumulative share"]


def test_an_undecided_check_reads_unsure_not_crossed_and_an_inconclusive_release_says_so():
    gate = _gate(0.009, 0.008, 0.011, 0.01)
    gate["checks"][0] |= {"passed": False, "state": "unsure", "bound": 0.011}
    manifest = {"method": "rtn", "format": "compressed-tensors", "base_model": {"path": "small"}, "layers": []}
    page = render_report("small-w4", manifest, gate, "inconclusive")
    kld_row = next(row for row in re.findall(r"<tr.*?</tr>", page, re.S) if "KL divergence, mean" in row)
    assert kld_row.startswith('<tr class="unsure">') and "<td>unsure</td>" in kld_row and "CROSSED" not in page
    assert '<p class="verdict">INCONCLUSIVE</p>' in page and "color:#9a6700" in page
