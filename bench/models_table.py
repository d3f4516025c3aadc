"""Render docs/models.md, the families × methods × formats × runtime table, from the compatibility
tests' results: the same cells and JSON lines as bench/compat_matrix.py (its run_tests and
OPTKIT_COMPAT_RESULTS), the rows of the tiny random model of each family (tests/tiny_families.py).

    python bench/models_table.py                 # runs tests/compat (as compat_matrix.py does)
    python bench/models_table.py --results F [G] # renders F, G (a later file's cell wins)

A cell reads "runtime ✔ · transformers ✔ · vLLM spec": optkit's runtime loaded the artifact (and
where transformers loads it too, both gave the same logits); transformers ✘ is a known breakage,
"—" no loader there; vLLM "spec": the artifact matches what vLLM's loader creates (not run).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compat_matrix import ROOT, run_tests  # noqa: E402  (the one mechanism: same tests, same results)

from optkit.compat import matrix  # noqa: E402
from optkit.families import family_for  # noqa: E402

TEMPLATE = ROOT / "docs" / "models.template.md"
FAMILY_ROW = " (tiny, random)"
SHORT = {"loads": "✔", "fails": "✘", "by spec": "spec", "no": "—", "untested": "untested"}


def render(cells: list[dict]) -> str:
    table: dict[str, dict[str, dict[str, str]]] = {}  # model_type -> column -> loader -> mark
    columns: list[str] = []
    for cell in cells:
        if not cell["row"].endswith(FAMILY_ROW):
            continue
        model_type = cell["row"].removesuffix(FAMILY_ROW)
        column = f"{cell['method']}<br>{cell['kind']}"
        if column not in columns:
            columns.append(column)
        table.setdefault(model_type, {}).setdefault(column, {})[cell["loader"]] = SHORT[cell["status"]]
    header = "| family | model_type | runtime | " + " | ".join(columns) + " |"
    lines = [header, "|" + "---|" * (3 + len(columns))]
    for model_type in sorted(table, key=lambda t: (family_for(t).name, t)):
        family = family_for(model_type)
        runtime = "✔" if family.runtime else "—"
        marks = [_mark(table[model_type].get(column, {})) for column in columns]
        lines.append(f"| {family.name} | {model_type} | {runtime} | " + " | ".join(marks) + " |")
    versions = {json.dumps(c["versions"], sort_keys=True) for c in cells if c["row"].endswith(FAMILY_ROW)}
    measured = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(json.loads(v).items()) if v) for v in versions)
    return "\n".join(lines) + f"\n\nMeasured with {measured}.\n"


def _mark(loaders: dict[str, str]) -> str:
    if not loaders:
        return "untested"
    names = {matrix.OPTKIT: "runtime", matrix.TRANSFORMERS: "transformers", matrix.VLLM: "vLLM"}
    return " · ".join(f"{label} {loaders[loader]}" for loader, label in names.items() if loader in loaders)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, nargs="+", help="JSON lines from test runs (default: run them)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "models.md")
    args = parser.parse_args()
    results = args.results
    if results is None:
        results = [Path(tempfile.mkdtemp()) / "compat.jsonl"]
        run_tests(results[0])
    cells = [json.loads(line) for file in results for line in file.read_text().splitlines() if line.strip()]
    args.out.write_text(TEMPLATE.read_text().replace("{{MODELS}}", render(cells)))
    print(f"wrote {args.out} ({len(cells)} results)")


if __name__ == "__main__":
    main()
