"""Byte-identity check of a refactor: build every method x format x family cell of tests/compat, and
`optkit run recipes/small-gptq-w4.yaml`, at a base revision (a git worktree) and in the working
tree, then compare what each wrote.

    python bench/seams_identity.py                        # every cell, base d92e6cf
    python bench/seams_identity.py --only gptq --only llama-fp8
    python bench/seams_identity.py --keep-base /tmp/seams-base   # re-runs build only the working tree
    python bench/seams_identity.py --list                 # the cells
    python bench/seams_identity.py --work /tmp/seams --json      # keep the artifacts; JSON report

Compared per cell: the sha256 of every tensor file written (*.safetensors, *.gguf, *.bin, *.pt,
*.pth, *.npy, *.npz) and the `layers` records of every optkit.json, whose keys that may legitimately
change are dropped: created, time, seconds, duration, path, version(s), commit, and any ending in
_s, _seconds, _time or _version (the manifest's other fields, timestamps, versions, paths and wall
times, are not compared at all); a GGUF file by its tensors and the manifest it embeds. The working
tree's records may add keys (it says which), never change or drop one. A cell that raised in either
tree counts as differing.

The cells are the base revision's (tests/compat/test_matrix.py's `_cells` and `_family_cells`, the
llama.cpp column's GGUF kinds, the compositions `optkit quantize` runs that the matrix lacks, and
the recipe), and each tree builds them with its own test_matrix `_quantize`, as the matrix does.
Each tree runs in its own interpreter (the shared .venv) with PYTHONPATH at that tree (bench/seams_build.py
checks optkit.__file__), CPU only, with --threads threads (OMP/MKL and torch.set_num_threads). The
tiny random family models are built once, by the working tree's tests/tiny_families.py, and both
trees read the same directories (the reference model `draft` is the working tree's). Exit 1 when
any cell differs.
"""

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(__file__).resolve().parent / "seams_build.py"


def _env(tree: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = str(threads)
    return {**env, "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1"}


def _driver(tree: Path, threads: int, *args: str, **popen) -> subprocess.Popen:
    command = [sys.executable, str(BUILD), str(tree), "--threads", str(threads), *args]
    return subprocess.Popen(command, cwd=tree, env=_env(tree, threads), **popen)


def _output(tree: Path, threads: int, *args: str):
    process = _driver(tree, threads, *args, stdout=subprocess.PIPE)
    stdout, _ = process.communicate()
    if process.returncode:
        sys.exit(f"bench/seams_build.py {' '.join(args)} failed in {tree} (exit {process.returncode})")
    return json.loads(stdout)


def _fingerprint(directory: str) -> str:
    """One hash of a model directory's files: a cached base digest is reused only on the same input."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(directory)).encode() + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _cached(cache: Path, meta: dict, cell: dict, fingerprints: dict) -> bool:
    """A base digest made from the same revision, thread count, cell and input model."""
    digest, meta_file = cache / f"{cell['id']}.json", cache / "meta.json"
    if not digest.exists() or not meta_file.exists() or json.loads(meta_file.read_text()) != meta:
        return False
    made = json.loads(digest.read_text())
    return made.get("cell") == cell and made.get("input") == fingerprints.get(cell.get("model"))


def _reset_stale(cache: Path, meta: dict) -> None:
    """Before building the base: digests of another revision or thread count go."""
    meta_file = cache / "meta.json"
    if meta_file.exists() and json.loads(meta_file.read_text()) != meta:
        for stale in cache.glob("*.json"):
            stale.unlink()
    cache.mkdir(parents=True, exist_ok=True)
    meta_file.write_text(json.dumps(meta))


def _compare(cell: str, base: dict, tree: dict) -> dict:
    for side, result in (("base", base), ("tree", tree)):
        if "error" in result:
            return {"cell": cell, "files": 0, "layers": 0, "status": "error", "detail": f"{side}: {result['error']}"}
    if "skipped" in base and "skipped" in tree:
        return {"cell": cell, "files": 0, "layers": 0, "status": "skipped", "detail": tree["skipped"]}
    differences = [k for k in ("exit", "skipped") if base.get(k) != tree.get(k)]
    a, b = base.get("files", {}), tree.get("files", {})
    differences += [f"files: {name}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
    a, b = base.get("layers", {}), tree.get("layers", {})
    added: set[str] = set()
    for name in sorted(set(a) | set(b)):
        extra = _added_keys(a.get(name), b.get(name))
        if extra is None:
            differences.append(f"layers: {name}")
        added |= extra or set()
    files = len(set(base.get("files", {})) | set(tree.get("files", {})))
    layers = sum(len(records) for records in tree.get("layers", {}).values())
    status = "different" if differences else "identical"
    detail = differences or ([f"records add {', '.join(sorted(added))}"] if added else [])
    return {"cell": cell, "files": files, "layers": layers, "status": status, "detail": "; ".join(detail)}


def _added_keys(base: list[dict] | None, tree: list[dict] | None) -> set[str] | None:
    """The keys the tree's layer records add to the base's, every base key equal (None: they differ).
    A refactor may record more about a layer (smoothquant+gptq through GPTQ's own step: rtn_loss,
    damp); it may not change or drop what was recorded."""
    if base is None or tree is None or len(base) != len(tree):
        return None if base != tree else set()
    added: set[str] = set()
    for old, new in zip(base, tree, strict=True):
        if any(k not in new or json.dumps(new[k]) != json.dumps(v) for k, v in old.items()):
            return None
        added |= set(new) - set(old)
    return added


def _print_table(rows: list[dict], base_rev: str, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"byte identity: {base_rev[:10]} vs working tree")
    for column in ("cell", "files compared", "layer records", "result", "what differs"):
        table.add_column(column, overflow="fold")
    style = {"identical": "green", "skipped": "yellow"}
    for row in rows:
        colour = style.get(row["status"], "red")
        result = f"[{colour}]{row['status']}[/]"
        table.add_row(row["cell"], str(row["files"]), str(row["layers"]), result, row["detail"])
    console = Console(soft_wrap=True)
    natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    table.width = max(natural, console.width) if natural > console.width else None  # whole cell names
    console.print(table)
    console.print(f"({seconds:.0f}s)")


def _summary(rows: list[dict]) -> str:
    bad = [r["cell"] for r in rows if r["status"] in ("different", "error")]
    skipped = sum(r["status"] == "skipped" for r in rows)
    note = f" ({skipped} skipped in both)" if skipped else ""
    if not bad:
        return f"{len(rows)} cells, all identical{note}"
    return f"{len(rows)} cells, {len(bad)} differ{note}: {', '.join(bad)}"


@contextlib.contextmanager
def _worktree(rev: str):
    """A detached git worktree of `rev`, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="seams-base-")) / "tree"
    try:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True)
        yield path
    finally:
        if path.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
        shutil.rmtree(path.parent, ignore_errors=True)


def _cells(cache: Path, meta: dict, base_tree, threads: int) -> list[dict]:
    """The base revision's cells (what the refactor must keep), listed once per cache."""
    listed = cache / "cells.json"
    if listed.exists() and (cache / "meta.json").exists() and json.loads((cache / "meta.json").read_text()) == meta:
        return json.loads(listed.read_text())
    cells = _output(base_tree(), threads, "--list")
    _reset_stale(cache, meta)
    listed.write_text(json.dumps(cells))
    return cells


def _build(jobs: list[tuple], threads: int, inputs_file: Path, keep: bool) -> None:
    running = []
    for tree, cells, out, label in jobs:
        args = ["--cells", str(cells), "--inputs", str(inputs_file), "--out", str(out), "--label", label]
        running.append(_driver(tree, threads, *args, *(["--keep-artifacts"] if keep else [])))
    if any(process.wait() for process in running):
        sys.exit("a build failed: see the output above")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="d92e6cf", help="base revision (default: d92e6cf)")
    parser.add_argument("--only", action="append", metavar="SUBSTRING", help="cells whose id contains it (repeatable)")
    parser.add_argument("--keep-base", type=Path, metavar="DIR", help="cache the base's digests (and inputs) here")
    parser.add_argument("--work", type=Path, metavar="DIR", help="build here, keep the artifacts")
    parser.add_argument("--threads", type=int, default=1, help="threads per tree (default: 1)")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON instead of a table")
    args = parser.parse_args()
    start = time.perf_counter()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{args.base}^{{commit}}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    work = args.work or Path(tempfile.mkdtemp(prefix="seams-identity-"))
    cache = (args.keep_base or work / "base").resolve()
    meta = {"base": rev, "threads": args.threads}
    with contextlib.ExitStack() as stack:
        trees = []  # the base's worktree, made when first needed

        def base_tree() -> Path:
            trees.append(trees[0] if trees else stack.enter_context(_worktree(rev)))
            return trees[0]

        cells = [
            c
            for c in _cells(cache, meta, base_tree, args.threads)
            if not args.only or any(s in c["id"] for s in args.only)
        ]
        if args.list or not cells:
            print("\n".join(c["id"] for c in cells) if cells else f"no cell matches {args.only}")
            return 0 if cells else 2
        families = sorted({c["model"] for c in cells if "model" in c} - {"draft"})
        inputs = _output(ROOT, args.threads, "--families", str(cache / "inputs"), *families)
        fingerprints = {name: _fingerprint(directory) for name, directory in inputs.items()}
        work.mkdir(parents=True, exist_ok=True)
        (work / "inputs.json").write_text(json.dumps({**inputs, "fingerprints": fingerprints}))
        missing = [c for c in cells if not _cached(cache, meta, c, fingerprints)]
        jobs = [(ROOT, work / "tree-cells.json", work / "tree", "tree")]
        (work / "tree-cells.json").write_text(json.dumps(cells))
        if missing:
            (work / "base-cells.json").write_text(json.dumps(missing))
            jobs.append((base_tree(), work / "base-cells.json", cache, "base"))
        _build(jobs, args.threads, work / "inputs.json", keep=args.work is not None)
    rows = [
        _compare(c["id"], json.loads((cache / f"{c['id']}.json").read_text()),
                 json.loads((work / "tree" / f"{c['id']}.json").read_text()))
        for c in cells
    ]  # fmt: skip
    failed = any(r["status"] in ("different", "error") for r in rows)
    if failed:
        print(f"build logs: {cache / 'build.log'}, {work / 'tree' / 'build.log'}", file=sys.stderr)
    elif not args.work:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"base": rev, "seconds": round(seconds), "cells": rows, "summary": _summary(rows)}))
    else:
        _print_table(rows, rev, seconds)
        print(_summary(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
