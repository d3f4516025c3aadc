"""Render docs/compatibility.md from the compatibility tests' results.

    python bench/compat_matrix.py               # runs tests/compat (all cells, -m compat included)
    python bench/compat_matrix.py --results F [G]   # renders F, G (JSON lines written by
                                                    # OPTKIT_COMPAT_RESULTS=F pytest ...); a later
                                                    # file's cell replaces an earlier one's

Cells: ✔ loaded with logits within tolerance of optkit's runtime; ✘ failed (the known breakage
named below); "by spec" matches what vLLM's loader creates but was not run; "—" the loader does not
read that format; "untested" not run here.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from optkit.compat import matrix

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "docs" / "compatibility.template.md"
MARKS = {"loads": "✔", "fails": "✘", "by spec": "by spec", "no": "—", "untested": "untested"}
COLUMNS = (
    matrix.OPTKIT,
    matrix.TRANSFORMERS,
    "transformers, dequantize=True",
    matrix.GPTQMODEL,
    matrix.VLLM,
    matrix.LLAMA_CPP,
)


def run_tests(results: Path) -> None:
    env = {**os.environ, "OPTKIT_COMPAT_RESULTS": str(results)}
    tests = ["tests/compat/test_matrix.py", "tests/compat/test_llama_cpp_column.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def render(cells: list[dict]) -> str:
    rows: dict[tuple, dict[str, str]] = {}
    version_sets = {json.dumps(cell["versions"], sort_keys=True) for cell in cells}
    for cell in cells:
        key = (cell["row"], cell["method"], cell["kind"])
        mark = MARKS[cell["status"]]
        if cell["status"] == "fails":
            mark = "✘ (1)"
        elif cell["status"] == "by spec":
            mark = f"by spec ({cell['path']})"
        elif cell["status"] == "no" and cell["loader"] == matrix.VLLM:
            mark = "✘ by spec (2)"
        rows.setdefault(key, {})[cell["loader"]] = mark
    lines = ["| model | method | artifact | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (3 + len(COLUMNS))]
    for (row, method, kind), marks in sorted(rows.items()):
        lines.append(f"| {row} | {method} | {kind} | " + " | ".join(marks.get(c, "—") for c in COLUMNS) + " |")
    measured = "; ".join(
        ", ".join(f"{k} {v}" for k, v in sorted(json.loads(vs).items()) if v) for vs in sorted(version_sets)
    )
    b = matrix.CT_ASYM_TRANSFORMERS_5_23
    notes = [
        f"Measured with {measured}.",
        "",
        f"(1) {b.summary}: broken with {' and '.join(f'{p} `{r}`' for p, r in b.broken.items())} "
        f"(loads with {_sets(b.measured_ok)}; fails with {_sets(b.measured_broken)}). "
        f"Where: {b.upstream}. Workaround: {b.remedy}.",
        "",
        "(2) vLLM's CompressedTensorsWNA16 takes zero points at 4 and 8 bits only (WNA16_ZP_SUPPORTED_TYPES_MAP).",
        "",
        "—: the loader does not read that format, or (dequantize=True) the default load already works.",
    ]
    return "\n".join(lines + [""] + notes) + "\n"


def _sets(version_sets: tuple[dict[str, str], ...]) -> str:
    return "; ".join(" + ".join(f"{p} {v}" for p, v in sorted(vs.items())) for vs in version_sets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", type=Path, nargs="+", help="JSON lines from test runs (default: run the tests now)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    args = parser.parse_args()
    results = args.results
    if results is None:
        results = [Path(tempfile.mkdtemp()) / "compat.jsonl"]
        run_tests(results[0])
    cells = [json.loads(line) for file in results for line in file.read_text().splitlines() if line.strip()]
    text = TEMPLATE.read_text().replace("{{MATRIX}}", render(cells))
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(cells)} results)")


if __name__ == "__main__":
    main()
