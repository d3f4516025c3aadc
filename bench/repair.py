"""Repair against every uniform rung of the ladder and against a hand-made --ignore choice, in one run.

For each model (`small`, `small+outliers`, `small-moe`: each expert's w1/w2/w3 is a layer of its own,
the routers stay in full precision):
1. Spearman rank correlation of the cheap per-layer estimate (one backward pass) with exact swaps
   of every layer to full precision, on the held-out calibration windows (on uniform 4-bit g128,
   optkit's default).
2. Every quantized rung of repair's ladder (`--precisions`, default quant/ladder.py's DEFAULT_LADDER:
   2-bit g128, g64, g32, 3-bit per channel, g128, g64, 4-bit per channel, g128, g64, g32, 8-bit
   g128) quantized uniformly with RTN and gated.
3. For each target KLD: the repaired artifact, from the smallest rung (`start: smallest`: uniform
   2-bit g128, layers raised along the ladder), beside the smallest uniform artifact that passes the
   same gate, and beside the best --ignore choice of at most the repaired artifact's size: for each
   uniform rung smaller than the repaired artifact, the layers with the largest relative weight error
   in its manifest kept in full precision while they fit; the lowest KLD among them is shown.

Usage: python bench/repair.py [--windows 24] [--targets 0.01 0.005 0.002] [--models small small+outliers small-moe]
       [--precisions w3g128 w4ch w4g128 w4g64 w4g32 8 16] [--no-spearman] [--json FILE]
(small-moe's uniform KLDs are smaller: uniform 3-bit passes 0.005 there; --targets 0.001 0.0005
0.0002 0.0001 make repair work harder)
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from optkit.gate.attribution import attribute
from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions, RepairOptions
from optkit.manifest import read_manifest
from optkit.modeldir import resolve_model_dir
from optkit.pipeline.repair import repair, size_mb
from optkit.quant.ladder import DEFAULT_LADDER, Rung, layer_bytes, nominal_bits
from optkit.quant.mixed_artifact import artifact_scheme, write_mixed_artifact
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

DEFAULT = WeightScheme(bits=4, group_size=128)  # optkit's default: the Spearman check runs on it


def ladder(precisions: list[int | str]) -> list[WeightScheme]:
    """The quantized rungs of repair's ladder as uniform schemes, fewest bits per weight first."""
    rungs = RepairOptions(precisions=precisions).rungs
    return [r.scheme(DEFAULT) for r in sorted(rungs, key=lambda r: nominal_bits(r, DEFAULT)) if not r.full]


def model_dir(name: str, root: Path) -> Path:
    if name == "small+outliers":
        from optkit.zoo.outliers import add_activation_outliers

        return add_activation_outliers(resolve_model_dir("small"), root / "small-outliers")
    return resolve_model_dir(name)


def ignore_choice(start: Path, base: Path, max_mb: float, out: Path) -> Path | None:
    """Full precision for the layers of largest manifest error, as many as fit in `max_mb`."""
    manifest = read_manifest(start)
    scheme = artifact_scheme(manifest)
    room = (max_mb - size_mb(start)) * 2**20
    if room < 0:
        return None
    chosen: dict[str, int] = {}
    for layer in sorted(manifest["layers"], key=lambda x: x["rel_error"], reverse=True):
        extra = layer_bytes(layer["shape"], Rung(16), scheme) - layer_bytes(layer["shape"], Rung.of(scheme), scheme)
        if extra <= room:
            chosen[layer["name"]], room = 16, room - extra
    write_mixed_artifact(start, base, chosen, out, {})
    return out


def bench_model(
    name: str, targets: list[float], windows: int, root: Path, precisions: list[int | str], spearman: bool = True
) -> dict:
    base = model_dir(name, root)
    gate = GateOptions(max_windows=windows)
    artifacts = {}
    schemes = ladder(precisions)
    for scheme in schemes:
        out = root / f"{name}-{scheme.describe().replace(' ', '-')}"
        quantize_model(base, out, QuantizeOptions(weights=scheme), overwrite=True)
        artifacts[scheme.describe()] = (out, evaluate(out, base, gate))
    start_dir, _ = artifacts[schemes[0].describe()]
    result = {"model": name, "spearman": None, "uniform": {}, "targets": []}
    if spearman:
        t = time.perf_counter()
        ranked = attribute(artifacts[DEFAULT.describe()][0], base, windows=4, exact=-1)
        seconds = time.perf_counter() - t
        print(f"\n## {name}: per-layer sensitivity ({len(ranked.layers)} linears, {ranked.tokens} tokens)")
        print(f"Spearman(estimate, exact swaps) = {ranked.spearman:.3f}   (estimate + all swaps: {seconds:.0f}s)")
        result["spearman"] = ranked.spearman
    for label, (out, g) in artifacts.items():
        result["uniform"][label] = {"size_mb": size_mb(out), "kld": g.metrics["kld_mean"]}
        print(f"uniform {label:18s} {size_mb(out):6.3f} MB  KLD {g.metrics['kld_mean']:.5f}")
    print(
        "\n| target KLD | repaired MB | repaired KLD | evals | smallest uniform that passes | its MB | size ratio "
        "| --ignore from | --ignore MB | --ignore KLD | KLD ratio (ignore/repaired) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for target in targets:
        options = GateOptions(
            max_windows=windows,
            max_kld=target,
            repair=RepairOptions(windows=8, start="smallest", precisions=precisions),
        )
        work = root / f"{name}-work-{target}"
        outcome = repair(start_dir, base, options, work, initial=evaluate(start_dir, base, options))
        passing = [(size_mb(o), label) for label, (o, g) in artifacts.items() if g.metrics["kld_mean"] <= target]
        smallest = min(passing) if passing else (float("nan"), "none")
        repaired_mb = size_mb(outcome.artifact)
        ignores = []  # (KLD, MB, from): the best --ignore choice of at most the repaired size
        for label, (uniform_dir, _) in artifacts.items():
            ignore = ignore_choice(uniform_dir, base, repaired_mb, root / f"{name}-ignore-{target}-{label}")
            if ignore is not None:
                ignores.append((evaluate(ignore, base, options).metrics["kld_mean"], size_mb(ignore), label))
        ignore_kld, ignore_mb, ignore_from = min(ignores) if ignores else (float("nan"), float("nan"), "none")
        row = {
            "target": target,
            "passed": outcome.passed,
            "repaired_mb": repaired_mb,
            "repaired_kld": outcome.gate.metrics["kld_mean"],
            "evaluations": len(outcome.steps) - 1,
            "steps": [(step["size_mb"], step["kld_mean"], step["passed"]) for step in outcome.steps],
            "raised": {k: v.label for k, v in outcome.raised.items()},
            "uniform": smallest[1],
            "uniform_mb": smallest[0],
            "ignore_from": ignore_from,
            "ignore_mb": ignore_mb,
            "ignore_kld": ignore_kld,
        }
        result["targets"].append(row)
        print(
            f"| {target:g} | {repaired_mb:.3f} | {row['repaired_kld']:.5f} {'pass' if outcome.passed else 'FAIL'} "
            f"| {row['evaluations']} | {smallest[1]} | {smallest[0]:.3f} | {repaired_mb / smallest[0]:.3f} "
            f"| {ignore_from} | {ignore_mb:.3f} | {ignore_kld:.5f} | {ignore_kld / row['repaired_kld']:.2f} |"
        )
        rungs = sorted({v.label for v in outcome.raised.values()})
        print(f"  raised {len(outcome.raised)} linears to {', '.join(rungs) or 'nothing'}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "small+outliers", "small-moe"])
    parser.add_argument("--targets", nargs="+", type=float, default=[0.01, 0.005, 0.002])
    parser.add_argument("--windows", type=int, default=24, help="gate windows of 256 tokens (heldout)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-spearman", action="store_true", help="skip the exact swaps of every layer")
    parser.add_argument(
        "--precisions", nargs="+", default=list(DEFAULT_LADDER), help="repair's ladder (8, 16, w3g128, ...)"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="optkit-bench-repair-"))
    try:
        precisions = [int(p) if p.isdigit() else p for p in map(str, args.precisions)]
        results = [
            bench_model(name, args.targets, args.windows, root, precisions, not args.no_spearman)
            for name in args.models
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
