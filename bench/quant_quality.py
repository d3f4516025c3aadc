"""Quality, time and memory of each quantization method on a reference model, in one run.

Prints method × bits × group size -> perplexity, Δppl %, mean KLD, same-top-token %, wall time and
peak memory, with RTN measured in the same run as the baseline, then the memory bound of the
layer-by-layer pipeline: model size + 3 × largest layer (fp32) + activation cache.

Usage: python bench/quant_quality.py [--model small] [--bits 4 3] [--group-sizes 128 32] [--seeds 0 1 2] [--json]
On a mixture of experts (`--model small-moe`) it also prints each expert's share of the eval set's
routing choices (base model), each expert's calibration tokens from the manifests (the default,
every token through every expert weighted by the router, and `gptq routed`: only the routed
tokens), and the issue-19
checks: GPTQ's Δppl ≤ 0.6× RTN's, and the default calibration's KLD ≤ the routed one's.
With several --seeds, each calibrated method runs once per calibration seed and a "mean" row gives
the mean (± standard deviation of Δppl): on a small model one seed's Δppl can move by more than
the difference between methods.
Every claim against RTN is a paired comparison on the same windows (gate/compare.py, as `optkit
eval A --compare B`): the "KLD − RTN" column is the difference of mean KLD with its 95% interval
and p-value, and a check is "met" only when the interval says so, "not shown" when it holds 0.
Peak RSS is measured after one warm-up GPTQ quantization of the same model (so one-time costs
such as imports and kernel caches sized by its shapes are not counted), and with glibc's mmap
threshold lowered for the whole run, so that freed tensors go back to the OS at once and RSS
follows live memory.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gguf_quality  # bench/gguf_quality.py, beside this script
import torch
from rich.console import Console
from rich.table import Table

from optkit.gate.compare import compare_windows
from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.memory import PeakMemory
from optkit.modeldir import resolve_model_dir, weight_files
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.methods.awq.options import AWQOptions
from optkit.quant.methods.composition import resolve
from optkit.quant.methods.gptq.options import GPTQOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

# label -> (method, format, symmetric, the method's options); each row is compared with the RTN
# row of the same symmetry
VARIANTS = {
    "rtn": ("rtn", "compressed-tensors", True, {}),
    "gptq": ("gptq", "compressed-tensors", True, {}),
    "gptq act-order": ("gptq", "gptq", True, {"gptq": GPTQOptions(act_order=True)}),
    # mixtures of experts: each expert's statistics from the tokens routed to it only (the default:
    # every calibration token through every expert, weighted by the router: quant/moe.py)
    "gptq routed": ("gptq", "compressed-tensors", True, {"moe_calibration": "routed"}),
    "gptq act-order static": (
        "gptq",
        "compressed-tensors",
        True,
        {"gptq": GPTQOptions(act_order=True, static_groups=True)},
    ),
    "nf4": ("nf4", "bitsandbytes", True, {}),  # compare with rtn at --group-sizes 64 (NF4's block)
    "nf4 double-quant": ("nf4", "bitsandbytes", True, {"double_quant": True}),
    "rtn asym": ("rtn", "compressed-tensors", False, {}),
    "awq asym": ("awq", "compressed-tensors", False, {}),
    "awq asym autoawq-clip": (
        "awq",
        "compressed-tensors",
        False,
        {"awq": AWQOptions(clip_ends="shared", clip_qk=False)},
    ),
}


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@dataclass
class RunSettings:
    """--max-windows and --num-samples: a shorter run (the defaults are the full measurement)."""

    max_windows: int | None = None  # gate windows of the eval set (None: all)
    num_samples: int = 128  # calibration sequences


RUN = RunSettings()


def _libc():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_tensors_out_of_the_heap() -> None:
    """glibc only, for the rest of the process: serve every allocation over 64 KiB by mmap, so that
    freeing it returns it to the OS at once.

    Set once, before anything is measured: the threshold only decides where new memory comes
    from, while a request that fits a free chunk already in the heap is served from that chunk, and
    a chunk freed inside the heap stays resident. Lowered only around each quantization (as this
    bench first did), the evaluations in between left ~1 GB of free heap chunks that the next
    quantization reused, so its peak counted the heap pages it touched rather than what was live:
    the same GPTQ run of small measured 50 MB first and 53 MB after two evaluations. Costs ~4 s of
    page faults per evaluation of small."""
    libc = _libc()
    if libc:
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)


@contextlib.contextmanager
def rss_follows_live_memory():
    """Start a measurement with no freed memory resident: collect garbage and give free heap
    pages back to the OS (glibc), so that every page the measured call touches counts."""
    gc.collect()
    libc = _libc()
    if libc:
        libc.malloc_trim(0)
    yield


def base_model(model: str, tmp: Path) -> str | Path:
    """The model to quantize: `NAME+outliers` is a copy of NAME with activation outliers and the
    same function (optkit/zoo/outliers.py), written under tmp."""
    if model.endswith("+outliers"):
        from optkit.zoo.outliers import add_activation_outliers

        return add_activation_outliers(model.removesuffix("+outliers"), tmp / model)
    return model


W8A8_METHODS = (
    ("w8a8", 0.5),
    ("smoothquant", 0.5),
    ("smoothquant", "auto"),
    ("smoothquant+gptq", 0.5),
    ("fp8", 0.5),
    ("smoothquant+fp8", 0.5),
)


def w8a8_rows(model: str, tmp: Path, eval_set: str, only: list[str] | None = None) -> list[dict]:
    """W8A8 methods (int8 and FP8) on the model and on a copy with activation outliers (same function)."""
    from optkit.quant.methods.smoothquant.options import SmoothQuantOptions
    from optkit.weights.schemes import FP8_PER_CHANNEL, W8_PER_CHANNEL
    from optkit.zoo.outliers import add_activation_outliers

    rows = []
    outliers = add_activation_outliers(model, tmp / "outliers")
    for base, label in ((resolve_model_dir(model), model), (outliers, f"{model}+outliers")):
        for method, alpha in W8A8_METHODS:
            if only and method not in only:
                continue
            out = tmp / f"{label}-{method}-{alpha}"
            weights = FP8_PER_CHANNEL if method.endswith("fp8") else W8_PER_CHANNEL
            options = QuantizeOptions(
                method=method,
                weights=weights,
                smoothquant=SmoothQuantOptions(alpha=alpha),
                calibration=CalibrationOptions(num_samples=RUN.num_samples),
            )
            start = time.perf_counter()
            quantize_model(base, out, options)
            seconds = time.perf_counter() - start
            m = evaluate(out, base, GateOptions(eval_set=eval_set, max_windows=RUN.max_windows)).metrics
            rows.append(
                {
                    "model": label,
                    "method": method,
                    "alpha": alpha,
                    "ppl_increase_pct": m["ppl_increase_pct"],
                    "kld_mean": m["kld_mean"],
                    "top1_pct": m["top1_pct"],
                    "quantize_s": seconds,
                }
            )
    return rows


def memory_bound(model: str | Path, calibration: CalibrationOptions) -> dict[str, int]:
    from transformers import AutoConfig

    path = resolve_model_dir(model)
    config = AutoConfig.from_pretrained(path)
    h, i = config.hidden_size, config.intermediate_size
    experts = getattr(config, "num_local_experts", None) or 1  # Mixtral: intermediate_size is one expert's
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    layer_params = h * h * 2 + h * kv * 2 + 3 * h * i * experts + 2 * h
    sizes = {
        "model_bytes": sum(f.stat().st_size for f in weight_files(path)),
        "largest_layer_fp32_bytes": 4 * layer_params,
        "activation_cache_bytes": 4 * calibration.num_samples * calibration.seq_len * h,
    }
    sizes["bound_bytes"] = (
        sizes["model_bytes"] + 3 * sizes["largest_layer_fp32_bytes"] + sizes["activation_cache_bytes"]
    )
    return sizes


def run_variant(
    model: str, out: Path, label: str, bits: int, group_size: int, eval_set: str, seed: int | None = None
) -> dict:
    method, fmt, symmetric, method_options = VARIANTS[label]
    method_options = dict(method_options)
    weight_type = resolve(method).weights.weight_type  # nf4 for NF4
    double_quant = method_options.pop("double_quant", False)
    moe_calibration = method_options.pop("moe_calibration", "all")
    options = QuantizeOptions(
        method=method,
        format=fmt,
        **method_options,
        weights=WeightScheme(
            bits=bits, group_size=group_size, symmetric=symmetric, type=weight_type, double_quant=double_quant
        ),
        calibration=CalibrationOptions(seed=seed or 0, num_samples=RUN.num_samples, moe_calibration=moe_calibration),
    )
    start = time.perf_counter()
    with rss_follows_live_memory(), PeakMemory() as peak:
        manifest = quantize_model(model, out, options)
    seconds = time.perf_counter() - start
    result = evaluate(out, model, GateOptions(eval_set=eval_set, max_windows=RUN.max_windows))
    m = result.metrics
    return {
        "variant": label,
        "seed": seed,  # calibration seed; None for RTN
        "symmetric": symmetric,
        "bits": bits,
        "group_size": group_size,
        "ppl": m["ppl_artifact"],
        "ppl_base": m["ppl_base"],
        "ppl_increase_pct": m["ppl_increase_pct"],
        "kld_mean": m["kld_mean"],
        "top1_pct": m["top1_pct"],
        "quantize_s": seconds,
        "peak_rss_bytes": peak.rss_bytes,
        "peak_cuda_bytes": peak.cuda_bytes,
        "experts": expert_tokens(manifest),
        "_windows": result.windows,  # per-window sums: the paired comparisons (dropped before printing)
    }


def paired(a: dict, b: dict) -> dict[str, dict]:
    """A − B on the same windows: {metric: {difference, low, high, p_value, better}} (gate/compare.py)."""
    found = compare_windows(a["_windows"], b["_windows"])
    return {
        d.metric: {"difference": d.difference, "low": d.low, "high": d.high, "p_value": d.p_value, "better": d.better}
        for d in found
    }


def add_rtn_comparisons(rows: list[dict]) -> None:
    """Each row's paired difference with the RTN row of the same bits, group and symmetry (vs_rtn)."""
    rtn = {(r["bits"], r["group_size"], r["symmetric"]): r for r in rows if r["variant"].startswith("rtn")}
    for r in rows:
        base = rtn.get((r["bits"], r["group_size"], r["symmetric"]))
        if base is not None and base is not r:
            r["vs_rtn"] = paired(r, base)


def claim(difference: dict, lower_is_better: bool = True) -> str:
    """'met' when the interval shows A better, 'MISSED' when it shows A worse, else 'not shown'."""
    if difference["low"] <= 0 <= difference["high"]:
        return "not shown"
    return "met" if (difference["high"] < 0) == lower_is_better else "MISSED"


def expert_tokens(manifest: dict) -> dict[str, dict[str, int]]:
    """Each expert (`model.layers.0.block_sparse_moe.experts.1`) -> the calibration tokens its first
    linear's statistics came from and the tokens the router sent it, as the manifest records them."""
    experts = {}
    for layer in manifest["layers"]:
        if "routed_tokens" in layer:
            expert = layer["name"].rsplit(".", 1)[0]
            counts = {k: layer[k] for k in ("calibration_tokens", "routed_tokens") if k in layer}
            experts.setdefault(expert, counts | ({"fallback": layer["fallback"]} if "fallback" in layer else {}))
    return experts


def routing_shares(model: str | Path, eval_set: str) -> list[list[float]] | None:
    """[layer][expert]: the base model's share of the eval set's routing choices (None: not an MoE)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import pack_windows, tokenize_stream
    from optkit.modeldir import load_tokenizer
    from optkit.zoo.train import expert_token_shares

    path = resolve_model_dir(model)
    if AutoConfig.from_pretrained(path).model_type != "mixtral":
        return None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    windows = pack_windows(tokenize_stream(load_tokenizer(path), load_text_set(eval_set).texts), 256)
    return expert_token_shares(hf, windows[: RUN.max_windows]).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a model directory, a reference model, or NAME+outliers")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--bits", nargs="+", type=int, default=[4, 3])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[128, 32])
    parser.add_argument("--eval-set", default="heldout")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="calibration seeds of calibrated methods")
    parser.add_argument("--no-w8a8", action="store_true", help="skip the W8A8 (SmoothQuant, FP8) rows")
    parser.add_argument("--w8a8-methods", nargs="+", choices=sorted({m for m, _ in W8A8_METHODS}), help="only these")
    parser.add_argument("--no-weight-only", action="store_true", help="skip the weight-only rows")
    parser.add_argument(
        "--no-warm-up", action="store_true", help="skip the warm-up GPTQ run (peak RSS then counts one-time costs)"
    )
    parser.add_argument("--max-windows", type=int, default=None, help="gate on at most this many windows")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences")
    parser.add_argument("--gguf", action="store_true", help="add the GGUF rows through llama.cpp (gguf_quality.py)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model.endswith("+outliers") and not args.no_w8a8:
        parser.error("--model NAME+outliers needs --no-w8a8: the W8A8 rows of NAME include its outlier copy")
    torch.manual_seed(0)
    RUN.max_windows, RUN.num_samples = args.max_windows, args.num_samples

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        keep_tensors_out_of_the_heap()
        # The measured runs' shapes (2 samples of the measured length): GEMM buffers that MKL keeps
        # for the process, sized by the largest shapes seen, and the tokenizer's first load are paid
        # here. Warmed up on `draft` instead, the first GPTQ run of `small` came out 3 MB higher.
        warm_up = QuantizeOptions(method="gptq", calibration=CalibrationOptions(num_samples=2))
        model = base_model(args.model, Path(tmp))
        if not args.no_warm_up:
            quantize_model(model, Path(tmp) / "warm-up", warm_up)
        for bits in [] if args.no_weight_only else args.bits:
            for group_size in args.group_sizes:
                for label in args.variants:
                    for seed in [None] if VARIANTS[label][0] == "rtn" else args.seeds:
                        out = Path(tmp) / f"{label.replace(' ', '-')}-w{bits}-g{group_size}-s{seed}"
                        rows.append(run_variant(model, out, label, bits, group_size, args.eval_set, seed))
        w8a8 = [] if args.no_w8a8 else w8a8_rows(args.model, Path(tmp), args.eval_set, args.w8a8_methods)
        bound = memory_bound(model, CalibrationOptions())
        gguf = gguf_quality.rows(args.model, Path(tmp), args.eval_set) if args.gguf else []
        shares = routing_shares(model, args.eval_set)
    add_rtn_comparisons(rows)
    routed_checks = routed_comparisons(rows, args)
    for r in rows:
        r.pop("_windows", None)
    if args.json:
        print(
            json.dumps(
                {"rows": rows, "w8a8": w8a8, "memory": bound, "gguf": gguf, "shares": shares, "routed": routed_checks},
                indent=2,
            )
        )
        return
    print_tables(args, rows, w8a8, bound)
    if shares is not None:
        print_moe_tables(args, rows, shares, routed_checks)
    if gguf:
        Console(width=140).print(gguf_quality.table(args.model, args.eval_set, gguf))


def with_means(rows: list[dict]) -> list[dict]:
    """The rows, each calibrated variant's per-seed rows (consecutive) followed by their mean
    (variant "… mean"), with the standard deviation of its Δppl."""
    out: list[dict] = []
    for _, runs in itertools.groupby(rows, key=lambda r: (r["variant"], r["bits"], r["group_size"])):
        runs = list(runs)
        out.extend(runs)
        if runs[0]["seed"] is None:
            continue
        mean = {k: statistics.fmean(r[k] for r in runs) for k in ("ppl", "ppl_increase_pct", "kld_mean", "top1_pct")}
        mean["ppl_increase_sd"] = statistics.stdev(r["ppl_increase_pct"] for r in runs) if len(runs) > 1 else 0.0
        mean["quantize_s"] = statistics.fmean(r["quantize_s"] for r in runs)
        no_peak = {"peak_rss_bytes": None, "peak_cuda_bytes": None}
        mean_row = {**runs[0], **mean, **no_peak, "vs_rtn": None, "variant": f"{runs[0]['variant']} mean", "seed": None}
        out.append(mean_row)
    return out


def print_tables(args, rows: list[dict], w8a8: list[dict], bound: dict) -> None:
    mb = 1 / 2**20
    base_ppl = f"{rows[0]['ppl_base']:.3f}" if rows else "-"
    title = f"quantization quality on {args.model} ({args.eval_set}, base perplexity {base_ppl})"
    table = Table(title=title)
    columns = (
        "variant",
        "bits",
        "group",
        "perplexity",
        "Δppl %",
        "vs RTN",
        "mean KLD",
        "KLD − RTN [95%], p",
        "same top-1 %",
        "s",
        "peak MB",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "variant" else "right")
    rtn = {(r["bits"], r["group_size"], r["symmetric"]): r for r in rows if r["variant"].startswith("rtn")}
    seeds = len(args.seeds)
    for r in with_means(rows) if seeds > 1 else rows:
        base = rtn.get((r["bits"], r["group_size"], r["symmetric"]))
        ratio = f"{r['ppl_increase_pct'] / base['ppl_increase_pct']:.2f}×" if base else ""
        peak = r.get("peak_cuda_bytes") if r.get("peak_cuda_bytes") is not None else r.get("peak_rss_bytes")
        label = r["variant"]
        if seeds > 1 and r["seed"] is not None:
            label += f" s{r['seed']}"
        spread = f"±{r['ppl_increase_sd']:.3f}" if "ppl_increase_sd" in r else ""
        table.add_row(
            label,
            str(r["bits"]),
            str(r["group_size"]),
            f"{r['ppl']:.3f}",
            f"{r['ppl_increase_pct']:+.3f}{spread}",
            ratio,
            f"{r['kld_mean']:.5f}",
            _difference_cell((r.get("vs_rtn") or {}).get("kld_mean")),
            f"{r['top1_pct']:.2f}",
            f"{r['quantize_s']:.1f}",
            "" if peak is None else f"{peak * mb:.1f}",
        )
    console = Console(width=None if sys.stdout.isatty() else 200)  # a log keeps the whole table
    if rows:
        console.print(table)
    if w8a8:
        table = Table(title="W8A8 (8-bit weights per channel, 8-bit activations per token: int8, or FP8 E4M3 for *fp8)")
        for column in ("model", "method", "α", "Δppl %", "mean KLD", "same top-1 %", "s"):
            table.add_column(column, justify="left" if column in ("model", "method") else "right")
        for r in w8a8:
            table.add_row(
                r["model"],
                r["method"],
                str(r["alpha"]),
                f"{r['ppl_increase_pct']:+.3f}",
                f"{r['kld_mean']:.5f}",
                f"{r['top1_pct']:.2f}",
                f"{r['quantize_s']:.1f}",
            )
        console.print(table)
    peaks = [r["peak_rss_bytes"] for r in rows if r["variant"].startswith("gptq") and r["peak_rss_bytes"] is not None]
    console.print(
        f"memory bound of the layer-by-layer pipeline: model {bound['model_bytes'] * mb:.1f} MB + 3 × largest "
        f"layer {bound['largest_layer_fp32_bytes'] * mb:.1f} MB + activation cache "
        f"{bound['activation_cache_bytes'] * mb:.1f} MB = {bound['bound_bytes'] * mb:.1f} MB; "
        f"peak RSS of GPTQ runs: {max(peaks) * mb:.1f} MB"
        if peaks
        else ""
    )


def _difference_cell(d: dict | None) -> str:
    if d is None:
        return ""
    return f"{d['difference']:+.5f} [{d['low']:+.5f}, {d['high']:+.5f}], p {d['p_value']:.2g}"


def routed_comparisons(rows: list[dict], args) -> list[dict]:
    """Per (bits, group): GPTQ's default calibration against `gptq routed`, paired on the windows."""
    by = {(r["variant"], r["bits"], r["group_size"]): r for r in rows if r["seed"] in (None, args.seeds[0])}
    found = []
    for bits, group in itertools.product(args.bits, args.group_sizes):
        gptq, routed = by.get(("gptq", bits, group)), by.get(("gptq routed", bits, group))
        if gptq and routed and "_windows" in gptq:
            found.append({"bits": bits, "group_size": group, **paired(gptq, routed)})
    return found


def print_moe_tables(args, rows: list[dict], shares: list[list[float]], routed_checks: list[dict]) -> None:
    """The eval set's routing shares, each expert's calibration tokens, and the issue-19 checks."""
    console = Console(width=None if sys.stdout.isatty() else 200)
    calibrated = {r["variant"]: r for r in rows if r["experts"]}  # one (bits, group) of each suffices
    table = Table(title=f"per expert: {args.eval_set} routing share (base model) and calibration tokens (manifest)")
    for column in ("expert", f"{args.eval_set} share", *(f"{v}: tokens" for v in calibrated)):
        table.add_column(column, justify="left" if column == "expert" else "right")
    num_experts = len(shares[0])
    for name in next(iter(calibrated.values()))["experts"] if calibrated else []:
        layer, expert = int(name.split(".layers.")[1].split(".")[0]), int(name.rsplit(".", 1)[1])
        cells = []
        for r in calibrated.values():
            counts = r["experts"][name]
            cell = f"{counts.get('calibration_tokens', '-')} (routed {counts['routed_tokens']})"
            cells.append(cell + (f" {counts['fallback']}" if "fallback" in counts else ""))
        table.add_row(f"layer {layer} expert {expert}", f"{shares[layer][expert]:.1%}", *cells)
    console.print(table)
    console.print(
        f"routing share: min {min(min(s) for s in shares):.1%}, max {max(max(s) for s in shares):.1%} "
        f"(even: {1 / num_experts:.1%})"
    )
    by = {(r["variant"], r["bits"], r["group_size"]): r for r in rows if r["seed"] in (None, args.seeds[0])}
    for bits, group in itertools.product(args.bits, args.group_sizes):
        rtn, gptq, routed = (by.get((v, bits, group)) for v in ("rtn", "gptq", "gptq routed"))
        if rtn and gptq:
            ratio = gptq["ppl_increase_pct"] / rtn["ppl_increase_pct"]
            verdict = "met" if ratio <= 0.6 else "MISSED"
            better = gptq.get("vs_rtn", {}).get("ppl_increase_pct")
            shown = f"; paired, GPTQ better: {claim(better)} (p {better['p_value']:.2g})" if better else ""
            console.print(f"w{bits} g{group}: GPTQ Δppl / RTN Δppl = {ratio:.2f} (target ≤ 0.6: {verdict}{shown})")
        check = next((c for c in routed_checks if (c["bits"], c["group_size"]) == (bits, group)), None)
        if gptq and routed and check:
            d = check["kld_mean"]
            console.print(
                f"w{bits} g{group}: KLD default calibration {gptq['kld_mean']:.5f} vs routed "
                f"{routed['kld_mean']:.5f}: default − routed {d['difference']:+.5f} [{d['low']:+.5f}, "
                f"{d['high']:+.5f}], p {d['p_value']:.2g} (target default < routed: {claim(d)})"
            )


if __name__ == "__main__":
    main()
