"""report.html renders in headless Chromium with its charts (Chromium: Debian's `chromium`)."""

import base64
import re
import shutil
import subprocess

import matplotlib.image
import numpy as np

from tests.pipeline.test_run import write_recipe

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
    assert [alt for alt, _ in images] == ["per-layer error", "KL divergence histogram"]
    for _, data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG")

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "install Debian's chromium (make install does where apt-get is available)"
    screenshot = tmp_path / "report.png"
    subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={screenshot}",
            "--window-size=1200,1600",
            report.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = matplotlib.image.imread(screenshot)[..., :3]
    chart_blue = np.array([0x1F, 0x77, 0xB4]) / 255  # the bars of both charts
    blue = (np.abs(pixels - chart_blue).max(axis=-1) < 0.03).sum()
    assert blue > 2000, "the charts did not render"
