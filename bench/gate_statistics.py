"""Does the gate prove what it says? Its statistics checked by simulation on a real artifact.

Quantizes --model (RTN, --bits), scores it once on the whole eval set (per-window sums, and the
task's answers per question), then treats that set as the population: its values are the truth,
and --runs draws of 8, 16, 32 and 64 windows (with replacement, so every draw is an i.i.d. sample
of it; task questions: 4x as many) measure
- `--decision confident` with max_kld at the full-set value: how often it passes (line: at most
  5% + 2 standard errors), and how often `point` disagrees with the full set (flips);
- `--sequential` (the bets of gate/sequential.py, read after every window) capped at each size and
  at the whole set: its error rate at the threshold (same line), and the mean windows it uses on an
  artifact at 0.5x and 2x the threshold (line: at most half the eval set);
- the 95% intervals' coverage of the full-set value for mean KLD, Δppl, top-1 and task accuracy
  (line: within 2 binomial standard errors of 95%);
then times real `optkit eval --sequential` runs at 0.5x and 2x against the full gate.

Usage: python bench/gate_statistics.py [--model small] [--bits 4] [--runs 1000] [--sizes 8 16 32 64]
       [--resamples 2000] [--no-timing] [--stats FILE] [--json]
--stats FILE keeps the artifact's per-window sums and task answers (safetensors): a rerun with the
same file skips quantizing and scoring (and the timing, which needs the artifact).
"""

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from optkit.gate.decision import decide
from optkit.gate.evaluate import evaluate
from optkit.gate.intervals import bootstrap_items, bootstrap_windows
from optkit.gate.metrics import WindowStats, window_metrics
from optkit.gate.options import GateOptions
from optkit.gate.sequential import MIN_PASS_WINDOWS, first_crossing, rules_for, window_observations
from optkit.gate.thresholds import Thresholds
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

ALPHA, CONFIDENCE = 0.05, 0.95


def line(rate: float, runs: int, nominal: float) -> float:
    """nominal + 2 binomial standard errors at `runs` draws."""
    return nominal + 2 * math.sqrt(nominal * (1 - nominal) / runs)


def fixed_sample(windows, answers, sizes: list[int], runs: int, resamples: int, seed: int) -> list[dict]:
    """Per size: confident/point at 1x, 0.5x, 2x the full-set KLD, and interval coverage."""
    truth = window_metrics(windows)
    base, artifact = answers
    truth_acc = artifact.double().mean().item()
    tau = truth["kld_mean"]
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in sizes:
        counts = {k: 0 for k in ("pass", "fail", "point_flip", "pass_half", "fail_double", "point_flip_half")}
        covered = {m: 0 for m in ("kld_mean", "ppl_increase_pct", "top1_pct", "task_acc_artifact")}
        for run in range(runs):
            subset = windows.select(torch.randint(len(windows), (n,), generator=generator))
            metrics = window_metrics(subset)
            bounds = bootstrap_windows(subset, resamples=resamples, seed=run)
            verdict = {
                scale: decide(metrics, Thresholds(max_kld=tau / scale), rule="confident", bounds=bounds, alpha=ALPHA)
                for scale in (1.0, 0.5, 2.0)
            }
            counts["pass"] += verdict[1.0].verdict == "pass"
            counts["fail"] += verdict[1.0].verdict == "fail"
            counts["point_flip"] += metrics["kld_mean"] > tau  # the full set passes (its value is the threshold)
            counts["pass_half"] += verdict[0.5].verdict == "pass"
            counts["fail_double"] += verdict[2.0].verdict == "fail"
            counts["point_flip_half"] += metrics["kld_mean"] > 2 * tau
            for metric in ("kld_mean", "ppl_increase_pct", "top1_pct"):
                low, high = bounds.interval(metric, CONFIDENCE)
                covered[metric] += low <= truth[metric] <= high
            questions = torch.randint(base.numel(), (4 * n,), generator=generator)
            items = bootstrap_items(base[questions], artifact[questions], resamples=resamples, seed=run)
            low, high = items.interval("task_acc_artifact", CONFIDENCE)
            covered["task_acc_artifact"] += low <= truth_acc <= high
        rows.append(
            {"windows": n, "questions": 4 * n, "runs": runs}
            | {k: v / runs for k, v in counts.items()}
            | {f"coverage_{k}": v / runs for k, v in covered.items()}
        )
    return rows


def sequential_runs(windows, caps: list[int], runs: int, seed: int) -> list[dict]:
    """Per cap: the bets on max_kld (and on all three window thresholds) read after every window."""
    truth = window_metrics(windows)
    n_all = len(windows)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for cap in caps:
        draws = torch.randint(n_all, (runs, cap), generator=generator)
        observed = {k: v[draws] for k, v in window_observations(windows).items()}
        row = {"cap": cap, "runs": runs}
        for scale, label in ((1.0, "at"), (0.5, "half"), (2.0, "double")):
            for which in ("kld", "all"):
                thresholds = _thresholds(truth, scale, which)
                passed, failed = _decide(thresholds, observed, cap)
                stop = torch.where(passed > 0, passed, torch.where(failed > 0, failed, cap)).double()
                row[f"{which}_{label}_pass"] = (passed > 0).double().mean().item()
                row[f"{which}_{label}_fail"] = (failed > 0).double().mean().item()
                row[f"{which}_{label}_windows"] = stop.mean().item()
        rows.append(row)
    return rows


def _thresholds(truth: dict, scale: float, which: str) -> Thresholds:
    """The artifact at `scale` x each threshold: a threshold at truth / scale (top-1: its loss)."""
    kld = Thresholds(max_kld=truth["kld_mean"] / scale)
    if which == "kld":
        return kld
    return kld.model_copy(
        update={
            "max_ppl_increase": truth["ppl_increase_pct"] / scale,
            "min_top1": 100 - (100 - truth["top1_pct"]) / scale,
        }
    )


def _decide(thresholds: Thresholds, observed: dict, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[runs] first window at which the gate passes (every pass side crossed) and fails (a reject
    side crossed at α/m); 0: never within the cap. As SequentialGate, vectorized over runs."""
    rules = rules_for(thresholds)
    passes, fails = [], []
    for rule in rules:
        x = observed[rule.name]
        skip = rule.pilot
        if skip:  # the bound from each run's own pilot windows
            half = 4.0 * (x[:, :skip] - rule.limit).abs().amax(-1)
            lower, upper, x = rule.limit - half, rule.limit + half, x[:, skip:]
        else:
            lower, upper = torch.tensor(rule.lower), torch.tensor(rule.upper)
        pass_w = (upper - rule.limit) if rule.below else (rule.limit - lower)
        reject_w = (rule.limit - lower) if rule.below else (upper - rule.limit)
        earliest = max(1, MIN_PASS_WINDOWS - skip)
        p = first_crossing(rule.pass_y(x), pass_w, ALPHA, earliest)
        f = first_crossing(rule.reject_y(x), reject_w, ALPHA / len(rules))
        passes.append(torch.where(p > 0, p + skip, 0))
        fails.append(torch.where(f > 0, f + skip, 0))
    never = cap + 1
    passed = torch.stack([torch.where(p > 0, p, never) for p in passes]).amax(0)
    failed = torch.stack([torch.where(f > 0, f, never) for f in fails]).amin(0)
    passed = torch.where((passed <= cap) & (passed < failed), passed, 0)
    failed = torch.where(failed <= cap, failed, 0)
    return passed, failed


def timing(artifact: Path, model: str, tau: float) -> list[dict]:
    """Wall time of the full gate against --sequential at 0.5x and 2x the threshold, in one run."""
    rows = []
    for label, limit, sequential in (("full gate", tau, False), ("sequential 0.5x", 2 * tau, True)) + (
        ("sequential 2x", tau / 2, True),
    ):
        start = time.perf_counter()
        result = evaluate(artifact, model, GateOptions(max_kld=limit, decision="confident", sequential=sequential))
        rows.append(
            {
                "run": label,
                "max_kld": limit,
                "verdict": result.verdict,
                "windows": result.eval_set["windows"],
                "seconds": time.perf_counter() - start,
            }
        )
    return rows


FIELDS = ("tokens", "nll_base", "nll_artifact", "kld", "top1")


def save_stats(path: Path, windows: WindowStats, answers: tuple[torch.Tensor, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tensors = {f: getattr(windows, f).contiguous() for f in FIELDS}
    tensors["base_correct"], tensors["artifact_correct"] = (a.to(torch.uint8) for a in answers)
    save_file(tensors, path)


def load_stats(path: Path) -> tuple[WindowStats, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = load_file(path)
    answers = (tensors["base_correct"].bool(), tensors["artifact_correct"].bool())
    return WindowStats(*(tensors[f] for f in FIELDS)), answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--task", default="next_line")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 16, 32, 64])
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples per interval")
    parser.add_argument("--no-timing", action="store_true", help="skip the timed real gates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", type=Path, help="reuse or write the per-window sums here (safetensors)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        artifact = Path(tmp) / f"{args.model}-rtn-w{args.bits}"
        if args.stats is not None and args.stats.exists():
            windows, answers = load_stats(args.stats)
            args.no_timing = True
        else:
            quantize_model(args.model, artifact, QuantizeOptions(weights=WeightScheme(bits=args.bits)))
            windows = evaluate(artifact, args.model, GateOptions()).windows
            answers = evaluate(artifact, args.model, GateOptions(task=args.task, max_windows=1)).answers
            if args.stats is not None:
                save_stats(args.stats, windows, answers)
        truth = window_metrics(windows)
        start = time.perf_counter()
        fixed = fixed_sample(windows, answers, args.sizes, args.runs, args.resamples, args.seed)
        sequential = sequential_runs(windows, [*args.sizes, len(windows)], args.runs, args.seed)
        simulated_s = time.perf_counter() - start
        timed = [] if args.no_timing else timing(artifact, args.model, truth["kld_mean"])
    report = {
        "artifact": f"{args.model} RTN w{args.bits}",
        "windows": len(windows),
        "questions": answers[0].numel(),
        "truth": truth | {"task_acc_artifact": answers[1].double().mean().item()},
        "fixed": fixed,
        "sequential": sequential,
        "timing": timed,
        "simulation_s": simulated_s,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_tables(report, args.runs)


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_tables(report: dict, runs: int) -> None:
    console = Console(width=None if sys.stdout.isatty() else 200)
    truth = report["truth"]
    console.print(
        f"{report['artifact']}: {report['windows']} windows, {report['questions']} task questions; full set: "
        f"KLD {truth['kld_mean']:.5f}, Δppl {truth['ppl_increase_pct']:+.3f}%, top-1 {truth['top1_pct']:.2f}%, "
        f"task accuracy {truth['task_acc_artifact']:.3f}; {runs} draws per size"
    )
    limit = line(ALPHA, runs, ALPHA)
    table = Table(title=f"fixed sample, max_kld at the full-set value (line: confident passes ≤ {limit:.1%})")
    for column in ("windows", "confident pass", "line", "confident fail", "point flips", "0.5x: pass", "2x: fail"):
        table.add_column(column, justify="right")
    for r in report["fixed"]:
        table.add_row(
            str(r["windows"]),
            f"{r['pass']:.1%}",
            _mark(r["pass"] <= limit),
            f"{r['fail']:.1%}",
            f"{r['point_flip']:.1%}",
            f"{r['pass_half']:.1%}",
            f"{r['fail_double']:.1%}",
        )
    console.print(table)
    low, high = 2 * CONFIDENCE - line(CONFIDENCE, runs, CONFIDENCE), line(CONFIDENCE, runs, CONFIDENCE)
    table = Table(title=f"coverage of the full-set value by the 95% intervals (line: {low:.1%} to {high:.1%})")
    for column in ("windows (questions)", "mean KLD", "Δppl", "top-1", "task accuracy"):
        table.add_column(column, justify="right")
    for r in report["fixed"]:
        cells = []
        for metric in ("kld_mean", "ppl_increase_pct", "top1_pct", "task_acc_artifact"):
            value = r[f"coverage_{metric}"]
            cells.append(f"{value:.1%}" + ("" if low <= value <= high else " MISSED"))
        table.add_row(f"{r['windows']} ({r['questions']})", *cells)
    console.print(table)
    half = report["windows"] / 2
    table = Table(title=f"--sequential, read after every window (lines: error ≤ {limit:.1%}; mean windows ≤ {half:g})")
    columns = ("thresholds", "cap", "at: pass", "at: fail", "0.5x: pass", "0.5x: windows", "2x: fail", "2x: windows")
    for column in columns:
        table.add_column(column, justify="right")
    for which, label in (("kld", "max_kld"), ("all", "kld+ppl+top1")):
        for r in report["sequential"]:
            table.add_row(
                label,
                str(r["cap"]),
                f"{r[f'{which}_at_pass']:.1%}" + ("" if r[f"{which}_at_pass"] <= limit else " MISSED"),
                f"{r[f'{which}_at_fail']:.1%}" + ("" if r[f"{which}_at_fail"] <= limit else " MISSED"),
                f"{r[f'{which}_half_pass']:.1%}",
                f"{r[f'{which}_half_windows']:.1f}",
                f"{r[f'{which}_double_fail']:.1%}",
                f"{r[f'{which}_double_windows']:.1f}",
            )
    console.print(table)
    if report["timing"]:
        full = report["timing"][0]["seconds"]
        table = Table(title="real gates, same run (max_kld; the full gate scores every window)")
        for column in ("run", "max_kld", "verdict", "windows", "seconds", "vs full gate"):
            table.add_column(column, justify="left" if column == "run" else "right")
        for r in report["timing"]:
            table.add_row(
                r["run"],
                f"{r['max_kld']:.5f}",
                r["verdict"],
                str(r["windows"]),
                f"{r['seconds']:.1f}",
                f"{full / r['seconds']:.1f}x faster" if r["run"] != "full gate" else "",
            )
        console.print(table)
    console.print(f"simulation: {report['simulation_s']:.0f} s")


if __name__ == "__main__":
    main()
