"""Render docs/compatibility.md from the compatibility tests' results.

    python bench/compat_matrix.py               # runs tests/compat (all cells, -m compat included)
    python bench/compat_matrix.py --results F [G]   # renders F, G (JSON lines written by
                                                    # OPTKIT_COMPAT_RESULTS=F pytest ...); a later
                                                    # file's cell replaces an earlier one's
    python bench/compat_matrix.py --results F --keep docs/compatibility.md
                                                    # update: F's cells replace the same cells of
                                                    # the current matrix, every other cell is kept
    python bench/compat_matrix.py --vllm            # the whole vLLM column (tests/compat/
                                                    # test_vllm_column.py, OPTKIT_VLLM_COLUMN=full)
                                                    # on top of the current matrix (--keep)

`--keep` is how a part of the matrix is regenerated from a run of only the tests that measure it
(e.g. the llama.cpp column: OPTKIT_COMPAT_RESULTS=F pytest tests/compat/test_llama_cpp_column.py),
or how cells measured in another environment (the gptqmodel venv) survive a run without it. Kept
cells keep their marks and the versions line keeps the versions they were measured with.

Cells: ✔ loaded with logits within tolerance of optkit's runtime; ✘ failed (the known breakage
named below); "by spec" matches what vLLM's loader creates but was not run (vLLM: or vLLM-CPU has
no kernel for it, named); "—" the loader does not read that format; "untested" not run here.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from optkit.compat import matrix, vllm_load

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


REFUSAL_NOTE = re.compile(r"^\((\d+)\) vLLM-CPU refuses it: `(.*)`\.$", re.MULTILINE)


def run_tests(results: Path, vllm: bool = False) -> None:
    """The compatibility tests, or with `vllm` the whole vLLM column alone."""
    env = {**os.environ, "OPTKIT_COMPAT_RESULTS": str(results)}
    tests = ["tests/compat/test_matrix.py", *(f"tests/compat/test_llama_cpp_{p}.py" for p in ("column", "families"))]
    if vllm:
        env["OPTKIT_VLLM_COLUMN"] = "full"
        tests = ["tests/compat/test_vllm_column.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def parse_matrix(text: str) -> tuple[dict[tuple, dict[str, str]], list[str]]:
    """A rendered matrix back as ((row, method, kind) -> {column: mark}, the version sets of its
    "Measured with" line): the cells `--keep` carries over. Columns are read by their header, so a
    matrix rendered before a column existed parses too (its rows lack that column's marks)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| model | method | artifact |")), None)
    if start is None:
        raise SystemExit("--keep: no matrix in that file (no '| model | method | artifact |' header)")
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows: dict[tuple, dict[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        values = [c.strip() for c in line.strip().strip("|").split("|")]
        row = dict(zip(header, values, strict=True))
        rows[(row["model"], row["method"], row["artifact"])] = {c: row[c] for c in header[3:]}
    measured = next((line for line in lines if line.startswith("Measured with ")), "Measured with .")
    return rows, [v for v in measured.removeprefix("Measured with ").removesuffix(".").split("; ") if v]


def parse_refusals(text: str) -> list[str]:
    """A rendered matrix's vLLM-CPU refusal footnotes, (3), (4), ... in their order: the kept cells'
    marks `✘ (N)` point at them."""
    notes = dict(REFUSAL_NOTE.findall(text))
    return [notes[str(n)] for n in range(3, 3 + len(notes)) if str(n) in notes]


def render(
    cells: list[dict], kept: tuple[dict[tuple, dict[str, str]], list[str]] | None = None, kept_refusals=()
) -> str:
    """The matrix of `cells`; with `kept` (parse_matrix's answer), on top of those cells, and the
    kept cells' refusal footnotes (parse_refusals) under their numbers."""
    rows: dict[tuple, dict[str, str]] = {key: dict(marks) for key, marks in (kept[0] if kept else {}).items()}
    version_sets = {json.dumps(cell["versions"], sort_keys=True) for cell in cells}
    # vLLM-CPU's own messages, numbered from (3)
    refusals = list(kept_refusals) or [vllm_load.NO_BNB.message]
    for cell in cells:
        key = (cell["row"], cell["method"], cell["kind"])
        rows.setdefault(key, {})[cell["loader"]] = _mark(cell, refusals)
    lines = ["| model | method | artifact | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (3 + len(COLUMNS))]
    for (row, method, kind), marks in sorted(rows.items()):
        lines.append(f"| {row} | {method} | {kind} | " + " | ".join(marks.get(c, "—") for c in COLUMNS) + " |")
    measured_sets = [", ".join(f"{k} {v}" for k, v in sorted(json.loads(vs).items()) if v) for vs in version_sets]
    measured = "; ".join(sorted(set(measured_sets) | set(kept[1] if kept else [])))
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
        *[f"({i}) vLLM-CPU refuses it: `{message}`.\n" for i, message in enumerate(refusals, start=3)],
        "—: the loader does not read that format, or (dequantize=True) the default load already works.",
    ]
    return "\n".join(lines + [""] + notes) + "\n"


def _mark(cell: dict, refusals: list[str]) -> str:
    """One cell's mark; a measured vLLM cell says its dtype (bf16 where vLLM-CPU needs it), and a
    refusal its footnote, numbered in `refusals`."""
    measured_vllm = cell["loader"] == matrix.VLLM and "dtype" in cell
    if cell["status"] == "fails" and measured_vllm:
        if cell["problem"] not in refusals:
            refusals.append(cell["problem"])
        return f"✘ ({refusals.index(cell['problem']) + 3})"
    if cell["status"] == "fails":
        return "✘ (1)"
    if cell["status"] == "by spec":
        return f"by spec ({cell['path']})"
    if cell["status"] == "no" and cell["loader"] == matrix.VLLM and cell["kind"].startswith("compressed"):
        return "✘ by spec (2)"
    if cell["status"] == "loads" and measured_vllm:
        return "✔ bf16" if cell["dtype"] == "bfloat16" else "✔"
    return MARKS[cell["status"]]


def _sets(version_sets: tuple[dict[str, str], ...]) -> str:
    return "; ".join(" + ".join(f"{p} {v}" for p, v in sorted(vs.items())) for vs in version_sets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", type=Path, nargs="+", help="JSON lines from test runs (default: run the tests now)"
    )
    parser.add_argument(
        "--keep", type=Path, help="a rendered matrix (docs/compatibility.md) whose cells this run does not measure stay"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    parser.add_argument(
        "--vllm", action="store_true", help="run the whole vLLM column (make vllm) and keep every other cell of --out"
    )
    args = parser.parse_args()
    results = args.results
    if args.vllm and args.keep is None and args.out.exists():
        args.keep = args.out
    if results is None:
        results = [Path(tempfile.mkdtemp()) / "compat.jsonl"]
        run_tests(results[0], vllm=args.vllm)
    cells = [json.loads(line) for file in results for line in file.read_text().splitlines() if line.strip()]
    kept_text = args.keep.read_text() if args.keep else ""
    kept = parse_matrix(kept_text) if args.keep else None
    text = TEMPLATE.read_text().replace("{{MATRIX}}", render(cells, kept, parse_refusals(kept_text)))
    tmp = args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, args.out)
    what = f", on top of {len(kept[0])} rows of {args.keep}" if kept else ""
    print(f"wrote {args.out} ({len(cells)} results{what})")


if __name__ == "__main__":
    main()
