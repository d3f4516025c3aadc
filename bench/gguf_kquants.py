"""K-quant rows of the GGUF benchmark (issue 33's pass lines): optkit's files of each llama.cpp mix
against llama.cpp's quantizer's of the same mix from the same full-precision GGUF, without and with
an importance matrix collected from optkit's calibration windows, all measured in llama.cpp:
perplexity, mean full-vocabulary KLD against the full-precision file's logits and the top-token
agreement on every `heldout` window (bench/gguf_scores.py), file sizes, and the decode speed of the
Q4_K_M files (median of alternated runs).

The full-precision file is `optkit quantize MODEL --format gguf --gguf-type F16`. llama.cpp's side
runs in process (bench/llama_cpp_quantizer.py: llama-imatrix's statistic from an eval callback on
the 128 windows of 256 tokens optkit's GPTQ reads, then llama_model_quantize as llama-quantize calls
it); with --tools, the llama-imatrix and llama-quantize binaries of bench/build_llama_cpp_tools.sh
instead (llama-imatrix then reads those windows decoded as text). Run by bench/gguf_quality.py --kquants.
"""

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import llama_cpp_quantizer
import llama_cpp_tools
import numpy as np
from gguf_scores import WindowScores, eval_windows, paired_ppl_ratio, score
from rich.table import Table

from optkit.data.eval_sets import load_text_set
from optkit.modeldir import load_tokenizer, resolve_model_dir
from optkit.quant.calibration_data import CalibrationOptions, calibration_data

K_MIXES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K")
DECODE_TOKENS = 256  # new tokens per decode run, after a 16-token prompt
NOISE_ONLY = ("Q6_K",)  # perplexity judged by the paired interval, not the point estimate
LQ, LQ_IM = "llama.cpp quantize", "llama.cpp quantize + imatrix"
OPTKIT_BIN = Path(sys.executable).with_name("optkit")


def _optkit_quantize(model: str, out: Path, gguf_type: str, method: str | None, extra: list[str]) -> None:
    command = [str(OPTKIT_BIN), "quantize", model, "--format", "gguf", "--gguf-type", gguf_type, "--out", str(out)]
    command += [*(["--method", method] if method else []), *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")


class LlamaCppSide:
    """llama.cpp's importance matrix and quantizer: in process, or its command-line tools."""

    def __init__(self, model: str, work: Path, threads: int, tools: bool):
        self.work, self.threads, self.tools = work, threads, tools
        self.options = CalibrationOptions()
        self.tokenizer = load_tokenizer(resolve_model_dir(model))
        self.windows = calibration_data(self.tokenizer, self.options).tokens

    def importance(self, full: Path) -> Path:
        """The importance matrix's file: llama-imatrix's GGUF, or the collector's means as .npz."""
        if self.tools:
            text, out = self.work / "calib.txt", self.work / "imatrix.gguf"
            decoded = (self.tokenizer.decode(w.tolist(), skip_special_tokens=True) for w in self.windows)
            text.write_text("\n".join(decoded))
            args = (full, text, out, self.threads, self.options.seq_len, self.options.num_samples)
            _built(out, llama_cpp_tools.imatrix, *args)
            return out
        out = self.work / "imatrix.npz"
        if not out.exists():
            np.savez(out, **llama_cpp_quantizer.importance_matrix(full, self.windows, self.threads))
        return out

    def quantize(self, full: Path, out: Path, mix: str, importance: Path | None) -> None:
        if self.tools:
            llama_cpp_tools.quantize(full, out, mix, self.threads, importance)
            return
        weights = dict(np.load(importance)) if importance else None
        llama_cpp_quantizer.quantize(full, out, mix, self.threads, weights)


def _built(path: Path, build, *args) -> float:
    """Seconds `build(*args)` took to write `path`; 0 when a previous run left it (--work)."""
    if path.exists():
        return 0.0
    start = time.perf_counter()
    build(*args)
    return time.perf_counter() - start


def build_files(model: str, work: Path, mixes: list[str], methods: list[str], threads: int, args):
    """Every file of the comparison: {(mix, variant): (path, seconds)}, and the full-precision file."""
    full = work / "full-F16.gguf"
    _built(full, _optkit_quantize, model, full, "F16", None, [])
    side = LlamaCppSide(model, work, threads, args.tools)
    importance = side.importance(full)
    files = {}
    for mix in mixes:
        plain, weighted = work / f"llama-cpp-{mix}.gguf", work / f"llama-cpp-imatrix-{mix}.gguf"
        files[mix, LQ] = plain, _built(plain, side.quantize, full, plain, mix, None)
        files[mix, LQ_IM] = weighted, _built(weighted, side.quantize, full, weighted, mix, importance)
        for method in methods:
            path = work / f"optkit-{method}-{mix}.gguf"
            extra = args.optkit_arg or []
            files[mix, f"optkit {method}"] = path, _built(path, _optkit_quantize, model, path, mix, method, extra)
    return full, files


def decode_speed(optkit_file: Path, reference: Path, prompt: list[int], threads: int, runs: int) -> dict:
    """Median decode speed in llama.cpp of each file over `runs` alternated runs."""
    speeds = {"optkit": [], LQ: []}
    for _ in range(runs):
        for name, path in (("optkit", optkit_file), (LQ, reference)):
            speeds[name].append(llama_cpp_quantizer.decode_tokens_per_s(path, prompt, DECODE_TOKENS, threads))
    medians = {k: statistics.median(v) for k, v in speeds.items()}
    return {"runs": speeds, "median": medians, "ratio": medians["optkit"] / medians[LQ]}


def rows(model: str, work: Path, mixes: list[str], methods: list[str], threads: int, windows, args) -> list[dict]:
    full, files = build_files(model, work, mixes, methods, threads, args)
    paths = {f"{m}|{v}": path for (m, v), (path, _) in files.items()}
    scores = cached_scores(full, paths, windows, threads)
    out = [_row("F16", "full precision (optkit F16)", full, 0.0, scores[str(full)])]
    for (mix, variant), (path, seconds) in files.items():
        out.append(_row(mix, variant, path, seconds, scores[f"{mix}|{variant}"]))
    return out


def cached_scores(full: Path, paths: dict[str, Path], windows, threads: int) -> dict[str, WindowScores]:
    """score(), each file's WindowScores kept beside it (--work) under the digest of the file, the
    base file and the windows, so a rerun scores only the files that changed."""
    key = _digest(full.read_bytes() + windows.numpy().tobytes())
    cache = {name: _cache_path(path, key) for name, path in paths.items()}
    cache[str(full)] = full.with_name(f"{full.name}.{key}.json")
    todo = {name: path for name, path in paths.items() if not cache[name].exists()}
    if todo or not cache[str(full)].exists():
        for name, found in score(full, todo, windows, threads).items():
            cache[name].write_text(json.dumps(asdict(found)))
    return {name: WindowScores(**json.loads(path.read_text())) for name, path in cache.items()}


def _cache_path(path: Path, key: str) -> Path:
    return path.with_name(f"{path.name}.{_digest(path.read_bytes())}-{key}.json")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def tool_cross_check(results: list[dict], work: Path, eval_set: str, threads: int) -> None:
    """llama-perplexity's own perplexity and --kl-divergence of every file on `eval_set`'s text (its
    tokenization, chunks of 256 tokens, the second half of each scored), added to each row."""
    text = work / f"{eval_set}.txt"
    text.write_text("\n".join(load_text_set(eval_set).texts))
    base = llama_cpp_tools.kld_base(work / results[0]["file"], text, work / "full-F16.kld", threads, 256)
    for row in results:
        found = llama_cpp_tools.perplexity_kld(work / row["file"], base, threads, 256)
        row["tool_ppl"], row["tool_kld_mean"] = found["ppl"], found["kld_mean"]


def _row(mix: str, variant: str, path: Path, seconds: float, s: WindowScores) -> dict:
    return {
        "type": mix, "variant": variant, "file": path.name, "bytes": os.path.getsize(path), "ppl": s.ppl,
        "kld_mean": s.kld_mean, "top1_pct": s.top1_pct, "build_s": seconds, "windows": len(s.tokens),
        "tokens": sum(s.tokens), "window_nll": s.nll,
    }  # fmt: skip


def _scores(row: dict) -> WindowScores:
    return WindowScores(nll=row["window_nll"], tokens=[row["tokens"] // row["windows"]] * row["windows"])


def checks(results: list[dict]) -> list[dict]:
    """The pass lines against both files of llama.cpp's quantizer: lower perplexity (at NOISE_ONLY types: not
    above the paired interval) and lower mean KLD, sizes under 1% apart."""
    by = {(r["type"], r["variant"]): r for r in results}
    out = []
    for (mix, variant), mine in by.items():
        if not variant.startswith("optkit"):
            continue
        for ref_name in (LQ, LQ_IM):
            ref = by[mix, ref_name]
            ratio, low, high = paired_ppl_ratio(_scores(mine), _scores(ref))
            ppl_ok = low <= 1.0 if mix in NOISE_ONLY else mine["ppl"] < ref["ppl"]
            size = mine["bytes"] / ref["bytes"] - 1
            out.append({
                "type": mix, "variant": variant, "against": ref_name, "ppl_ratio": ratio, "ppl_interval": [low, high],
                "kld_ratio": mine["kld_mean"] / ref["kld_mean"], "size_diff": size, "ppl_pass": ppl_ok,
                "kld_pass": mine["kld_mean"] < ref["kld_mean"], "size_pass": abs(size) < 0.01,
            })  # fmt: skip
    return out


def table(model: str, results: list[dict]) -> Table:
    full = results[0]
    t = Table(
        title=f"K-quants in llama.cpp on {model} (heldout, {full['windows']} windows, {full['tokens']} predicted "
        f"tokens; KLD against the F16 file in llama.cpp, whose perplexity is {full['ppl']:.4f})"
    )
    columns = ("MiB", "size ÷ lq", "perplexity", "ppl ÷ lq", "ppl ÷ lq+im", "mean KLD", "KLD ÷ lq", "KLD ÷ lq+im")
    tool = "tool_ppl" in full
    tool_columns = ("llama-perplexity ppl", "its KLD") if tool else ()
    for column in ("type", "file", *columns, "same top-1 %", *tool_columns, "build s"):
        t.add_column(column, justify="left" if column in ("type", "file") else "right")
    by = {(r["type"], r["variant"]): r for r in results}
    for r in results:
        plain, weighted = by.get((r["type"], LQ)), by.get((r["type"], LQ_IM))
        t.add_row(
            r["type"], r["variant"], f"{r['bytes'] / 2**20:.3f}", _ratio(r, plain, "bytes"), f"{r['ppl']:.4f}",
            _ratio(r, plain, "ppl"), _ratio(r, weighted, "ppl"), f"{r['kld_mean']:.5f}",
            _ratio(r, plain, "kld_mean"), _ratio(r, weighted, "kld_mean"), f"{r['top1_pct']:.2f}",
            *((f"{r['tool_ppl']:.4f}", f"{r['tool_kld_mean']:.5f}") if tool else ()), f"{r['build_s']:.1f}",
        )  # fmt: skip
    return t


def _ratio(row: dict, reference: dict | None, key: str) -> str:
    return f"{row[key] / reference[key]:.4f}" if reference else "-"


def check_lines(found: list[dict], decode: dict | None) -> list[str]:
    lines = []
    for c in found:
        low, high = c["ppl_interval"]
        verdict = "PASS" if c["ppl_pass"] and c["kld_pass"] and c["size_pass"] else "FAIL"
        lines.append(
            f"{verdict} {c['type']} {c['variant']} vs {c['against']}: ppl ×{c['ppl_ratio']:.4f} "
            f"[{low:.4f}, {high:.4f}] {'ok' if c['ppl_pass'] else 'NO'}, KLD ×{c['kld_ratio']:.3f} "
            f"{'ok' if c['kld_pass'] else 'NO'}, size {c['size_diff']:+.2%} {'ok' if c['size_pass'] else 'NO'}"
        )
    if decode:
        m = decode["median"]
        verdict = "PASS" if abs(decode["ratio"] - 1) <= 0.05 else "FAIL"
        lines.append(
            f"{verdict} Q4_K_M decode in llama.cpp (batch 1, {DECODE_TOKENS} tokens): optkit {m['optkit']:.1f} tok/s, "
            f"{LQ} {m[LQ]:.1f} "
            f"(median of {len(decode['runs']['optkit'])} alternated runs), ×{decode['ratio']:.3f}"
        )
    return lines


def run(args, threads: int, work: Path) -> dict:
    windows = eval_windows(args.model, args.eval_set, 256, args.max_windows)
    methods = args.methods or ["gptq"]
    results = rows(args.model, work, args.kquant_types, methods, threads, windows, args)
    if args.perplexity_tool:
        tool_cross_check(results, work, args.eval_set, threads)
    decode = None
    if "Q4_K_M" in args.kquant_types and args.decode_runs:
        mine, ref = work / f"optkit-{methods[0]}-Q4_K_M.gguf", work / "llama-cpp-Q4_K_M.gguf"
        decode = decode_speed(mine, ref, windows[0, :16].tolist(), threads, args.decode_runs)
    return {"rows": results, "checks": checks(results), "decode": decode}
