"""Every JSON optkit writes is JSON: no NaN or Infinity, which JavaScript's JSON.parse and other
strict parsers reject (optkit/json_strict.py). The manifests of FP8 and W8A8 artifacts, whose
layers have no calibration loss, and every command's --json output."""

import json
import math

import pytest

CALIBRATION = ("--num-samples", "8", "--seq-len", "64", "--device", "cpu")
METHODS = ("fp8", "smoothquant")  # FP8 W8A8, int8 W8A8


def strict_loads(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_and_nothing_else_changes():
    from optkit.json_strict import dumps, finite

    data = {"a": float("nan"), "b": [1.5, float("inf"), (-float("inf"), 2)], "c": {"d": "NaN", "e": 0, "f": None}}
    assert finite(data) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": "NaN", "e": 0, "f": None}}
    assert strict_loads(dumps(data)) == finite(data)
    with pytest.raises(ValueError):  # what a `default` hands back is checked too
        dumps({"x": object()}, default=lambda _: math.nan)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, draft_dir) -> dict:
    """An FP8 and a W8A8 artifact of `draft`, and what `optkit quantize --json` printed for each."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("strict-json")
    made = {}
    for method in METHODS:
        out = root / method
        done = subprocess.run(
            [sys.executable, "-m", "optkit.cli.main", "quantize", str(draft_dir), "--method", method,
             "--out", str(out), *CALIBRATION, "--json"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        made[method] = (out, done.stdout)
    return made


@pytest.mark.parametrize("method", METHODS)
def test_the_manifest_and_quantize_json_of_w8a8_artifacts_are_strict_json(artifacts, method):
    out, printed = artifacts[method]
    manifest = strict_loads((out / "optkit.json").read_text())
    assert strict_loads(printed)["layers"] == manifest["layers"]
    assert manifest["layers"] and all(layer["loss"] is None for layer in manifest["layers"])  # nothing measured it


@pytest.mark.parametrize(
    "command",
    [
        ("inspect", "{art}", "--json"),
        ("verify", "{art}", "--json"),
        ("eval", "{art}", "--baseline", "draft", "--max-windows", "8", "--json"),
        ("generate", "{art}", "Once upon", "--max-tokens", "2", "--device", "cpu", "--json"),
        ("zoo", "list", "--json"),
        ("quantize", "draft", "--method", "fp8", "--dry-run", "--json"),
    ],
    ids=lambda c: c[0],
)
def test_every_json_output_is_strict_json(artifacts, run_cli, command):
    art, _ = artifacts["fp8"]
    code, out, err = run_cli(*(part.format(art=art) for part in command))
    assert code == 0, err
    assert out.strip(), "no JSON printed"
    for document in _documents(out):
        strict_loads(document)


def _documents(out: str) -> list[str]:
    """One JSON document, or one per line (generate --json prints a line per prompt)."""
    try:
        json.loads(out)
        return [out]
    except json.JSONDecodeError:
        return [line for line in out.splitlines() if line.strip()]
