"""One tree's half of bench/seams_identity.py: build the identity check's artifacts with the optkit of
the tree that PYTHONPATH points at, and write each cell's digest (see seams_identity.py).

    PYTHONPATH=TREE python bench/seams_build.py TREE --list                 # the cells, JSON
    PYTHONPATH=TREE python bench/seams_build.py TREE --families OUT NAME...  # tiny family models
    PYTHONPATH=TREE python bench/seams_build.py TREE --cells F --inputs F --out DIR [--keep-artifacts]

Cells are listed from a tree's tests/compat/test_matrix.py (`_cells`, `_family_cells`) and are built by
its `_quantize`, the function the matrix itself builds them with; the GGUF cells are
tests/compat/test_llama_cpp_column.py's kinds (each on draft, Q8_0 on the families llama.cpp shares),
written by `quantize_model(..., format="gguf")` as that test does, and compared by their tensors and
the layer records of the manifest they embed (the file's own sha256 changes with its timings); the recipe cell runs
`python -m optkit.cli.main run TREE/recipes/small-gptq-w4.yaml --out ...` in that tree.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

RECIPE = "recipes/small-gptq-w4.yaml"
# compositions and activation settings the matrix has no cell for, through `optkit quantize draft`
COMPOSITIONS = {
    "smoothquant+gptq": ["--method", "smoothquant+gptq"],
    "smoothquant+gptq-static": ["--method", "smoothquant+gptq", "--act-quant", "static"],
    "smoothquant+fp8-static": ["--method", "smoothquant+fp8", "--act-quant", "static"],
    "smoothquant-alpha-0.5": ["--method", "smoothquant", "--alpha", "0.5"],
    "w8a8-static": ["--method", "w8a8", "--act-quant", "static"],
    "gptq-act-order": ["--method", "gptq", "--group-size", "32", "--act-order", "--format", "gptq"],
    "gptq-static-groups": ["--method", "gptq", "--group-size", "32", "--act-order", "--static-groups"],
}
# every file holding tensors: artifacts are directories of safetensors, GGUF is one file
TENSOR_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npy", ".npz")
MANIFEST = "optkit.json"
# layer-record keys that may legitimately change between trees: timings, versions, paths
DROPPED_KEYS = {"created", "time", "seconds", "duration", "path", "version", "versions", "commit"}
DROPPED_SUFFIXES = ("_s", "_seconds", "_time", "_version")


def _kept(key: str) -> bool:
    return key not in DROPPED_KEYS and not key.endswith(DROPPED_SUFFIXES)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _layer_records(manifest: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if _kept(k)} for r in manifest.get("layers", [])]


def _gguf_digest(path: Path) -> tuple[str, list[dict]]:
    """sha256 over every tensor's name, type, shape and bytes, and the embedded manifest's layer records."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    h = hashlib.sha256()
    for tensor in reader.tensors:
        h.update(f"{tensor.name}|{tensor.tensor_type.name}|{list(tensor.shape)}|".encode())
        h.update(tensor.data.tobytes())
    field = reader.get_field("optkit.manifest")
    manifest = json.loads(bytes(field.parts[field.data[0]]).decode()) if field is not None else {}
    return h.hexdigest(), _layer_records(manifest)


def digest(root: Path) -> dict:
    """sha256 of every tensor file under `root`, and every manifest's layer records (dropped keys out)."""
    files, layers = {}, {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        if path.name.endswith(".gguf"):
            files[rel], layers[rel] = _gguf_digest(path)
        elif path.name.endswith(TENSOR_SUFFIXES):
            files[rel] = _sha256(path)
        elif path.name == MANIFEST:
            layers[rel] = _layer_records(json.loads(path.read_text()))
    return {"files": files, "layers": layers}


def check_tree(tree: Path) -> None:
    import optkit

    where = Path(optkit.__file__).resolve()
    if not where.is_relative_to(tree.resolve()):
        sys.exit(f"optkit was imported from {where}, not from {tree}: set PYTHONPATH={tree}")


def list_cells() -> list[dict]:
    from tests.compat import test_matrix as m

    cells = [{"id": p.id, "model": "draft", "args": list(p.values)} for p in m._cells()]
    for p in m._family_cells():
        family, method, fmt, bits, symmetric = p.values
        activations = "dynamic" if method in ("smoothquant", "fp8") else "none"  # as the family test does
        cells.append({"id": p.id, "model": family, "args": [method, fmt, bits, symmetric, activations]})
    from tests.compat.test_llama_cpp_column import KINDS

    cells += [{"id": f"gguf-draft-{qtype}", "model": "draft", "gguf": qtype} for qtype in KINDS]
    cells += [{"id": f"gguf-{row}-Q8_0", "model": row, "gguf": "Q8_0"} for row in ("llama", "mistral", "qwen2")]
    cells += [{"id": f"cli-draft-{name}", "cli": args} for name, args in COMPOSITIONS.items()]
    cells.append({"id": "recipe-small-gptq-w4", "recipe": RECIPE})
    return cells


def _build_gguf(model: Path, qtype: str, out: Path) -> None:
    """As tests/compat/test_llama_cpp_column.py writes each GGUF kind (group size 32)."""
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme
    from tests.compat.test_llama_cpp_column import CALIB, KINDS

    method, bits, symmetric = KINDS[qtype]
    scheme = WeightScheme(bits=bits, group_size=32, symmetric=symmetric)
    out.mkdir(parents=True, exist_ok=True)
    options = QuantizeOptions(method=method, format="gguf", weights=scheme, calibration=CALIB)
    quantize_model(model, out / "model.gguf", options)


def build_families(out: Path, names: list[str]) -> dict[str, str]:
    from optkit.modeldir import resolve_model_dir
    from tests.tiny_families import save_tiny_family

    draft = resolve_model_dir("draft")
    made = {"draft": str(draft)}
    for name in names:
        if not (out / name / "config.json").exists():
            save_tiny_family(name, out / name, draft)
        made[name] = str(out / name)
    return made


def build(tree: Path, cell: dict, inputs: dict, out: Path) -> dict:
    if "recipe" in cell:  # a subprocess: the CLI as a user runs it (the same PYTHONPATH and threads)
        command = [sys.executable, "-m", "optkit.cli.main", "run", str(tree / cell["recipe"])]
        done = subprocess.run([*command, "--out", str(out / "release"), "--device", "cpu"], cwd=tree)
        if done.returncode not in (0, 1, 4):  # released, rejected, inconclusive: all write a release
            raise RuntimeError(f"optkit run exited {done.returncode}")
        return {"exit": done.returncode}
    if "cli" in cell:
        command = [sys.executable, "-m", "optkit.cli.main", "quantize", "draft", *cell["cli"], "--device", "cpu"]
        command += ["--num-samples", "8", "--seq-len", "64", "--out", str(out / "artifact")]
        subprocess.run(command, cwd=tree, check=True)
        return {}
    if "gguf" in cell:
        _build_gguf(Path(inputs[cell["model"]]), cell["gguf"], out / "artifact")
        return {}
    from tests.compat.test_matrix import _quantize

    _quantize(Path(inputs[cell["model"]]), out / "artifact", *cell["args"])
    return {}


def build_cells(tree: Path, cells: list[dict], inputs: dict, out: Path, keep: bool, threads: int, label: str) -> None:
    import torch

    torch.set_num_threads(threads)
    progress = os.fdopen(os.dup(2), "w", buffering=1)
    log = open(out / "build.log", "a")
    for cell in cells:
        work = out / cell["id"]
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        start = time.perf_counter()
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)  # optkit's progress bars go to the log
        try:
            print(f"=== {cell['id']}", flush=True)
            result = build(tree, cell, inputs, work)  # a recipe: the release, not its work directory
            result |= digest(work / "release" if "recipe" in cell else work)
        except BaseException as e:  # pytest.skip is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            traceback.print_exc()
            skipped = type(e).__name__ == "Skipped"
            result = {"skipped" if skipped else "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["input"] = inputs["fingerprints"].get(cell.get("model"))
        result["cell"] = cell
        (out / f"{cell['id']}.json").write_text(json.dumps(result, sort_keys=True, indent=1))
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        state = "error" if "error" in result else "skipped" if "skipped" in result else "built"
        print(f"  {label}: {cell['id']} {state} ({result['seconds']}s)", file=progress)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree", type=Path)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--families", nargs="+", metavar=("OUT", "NAME"))
    parser.add_argument("--cells", type=Path)
    parser.add_argument("--inputs", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep-artifacts", action="store_true")
    parser.add_argument("--label", default="tree", help="the progress lines' prefix")
    args = parser.parse_args()
    check_tree(args.tree)
    if args.list:
        print(json.dumps(list_cells()))
    elif args.families:
        print(json.dumps(build_families(Path(args.families[0]), args.families[1:])))
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        cells = json.loads(args.cells.read_text())
        build_cells(
            args.tree,
            cells,
            json.loads(args.inputs.read_text()),
            args.out,
            args.keep_artifacts,
            args.threads,
            args.label,
        )


if __name__ == "__main__":
    main()
