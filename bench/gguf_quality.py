"""GGUF rows of the quality benchmark: RTN, GPTQ and AWQ written as llama.cpp's Q4_0, Q4_1 and Q8_0,
and llama.cpp's own quantizer at the same type, all measured by the same gate through llama.cpp.

Every row is an `optkit eval model.gguf --baseline MODEL` (heldout, full-vocabulary KLD): llama.cpp
computes the artifact's logits, transformers the base's. Two reference rows are measured in the same
run: the full-precision model written as GGUF (llama.cpp's own error with unquantized weights) and,
per type, llama.cpp's quantizer (llama_model_quantize, round to nearest with its own scale choice) on
that file, with token_embd and output kept at the base dtype as optkit keeps them.

Usage: python bench/gguf_quality.py [--model small] [--types Q4_0 Q4_1 Q8_0]
[--methods rtn gptq awq llama.cpp] [--max-windows N] [--threads N] [--json] (the full-precision row comes
with llama.cpp's, whose input it is; needs the extra: pip install 'optkit[gguf]'). bench/quant_quality.py --gguf
prints the same table.

With --kquants: the K-quant mixes (bench/gguf_kquants.py) against llama.cpp's quantizer's without and
with an importance matrix, [--kquant-types Q4_K_M Q5_K_M Q3_K_M Q6_K] [--methods gptq] [--decode-runs 3]
[--work DIR (keep the files; a file already there is reused)] [--optkit-arg=--flag ...]; with the
command-line tools of bench/build_llama_cpp_tools.sh: [--tools (llama-imatrix and llama-quantize
instead of the same code in process)] [--perplexity-tool (llama-perplexity's own numbers as well)].

Threads (torch's for the base, llama.cpp's for the files) default to the cores
no other process keeps busy (optkit/gate/llama_cpp.idle_cores): on shared cores a spinning thread
that loses its core stalls the rest.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import gguf_kquants  # bench/gguf_kquants.py and llama_cpp_tools.py, beside this script
import llama_cpp_tools
from rich.console import Console
from rich.table import Table

from optkit.devices import set_cpu_threads
from optkit.gate.evaluate import evaluate
from optkit.gate.llama_cpp import idle_cores
from optkit.gate.options import GateOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

TYPES = {"Q4_0": (4, True), "Q4_1": (4, False), "Q8_0": (8, True)}
METHODS = ("rtn", "gptq", "awq")
LLAMA_CPP = "llama.cpp"  # llama.cpp's quantizer, and the full-precision file it starts from


def _gate(path: Path, model: str, options: GateOptions) -> dict:
    result = evaluate(path, model, options)
    keys = ("ppl_artifact", "ppl_base", "ppl_increase_pct", "kld_mean", "top1_pct")
    return {**{k: result.metrics[k] for k in keys}, "windows": result.eval_set["windows"], "gate_s": result.wall_time_s}


def full_precision_gguf(model: str, out: Path) -> Path:
    """The model as GGUF with no layer quantized (every linear ignored): the input of llama.cpp's quantizer."""
    options = QuantizeOptions(method="rtn", format="gguf", ignore=["*"], weights=WeightScheme(group_size=32))
    quantize_model(model, out, options)
    return out


def llama_cpp_quantize(source: Path, out: Path, qtype: str) -> Path:
    """llama.cpp's own quantizer on `source`, embeddings and output left at their dtype."""
    import llama_cpp
    from gguf import GGMLQuantizationType

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    # ggml's type ids (llama-cpp-python names no GGML_TYPE_BF16; gguf-py's enum is ggml's)
    params.token_embedding_type = int(GGMLQuantizationType.BF16)
    params.output_tensor_type = int(GGMLQuantizationType.BF16)
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    return out


def _row(variant: str, qtype: str, path: Path, seconds: float, model: str, options: GateOptions) -> dict:
    row = {"variant": variant, "type": qtype, "quantize_s": seconds, **_gate(path, model, options)}
    print(f"row {json.dumps(row)}", file=sys.stderr)  # a crash later loses no measured row
    return row


def rows(
    model: str,
    tmp: Path,
    eval_set: str = "heldout",
    types: list[str] | None = None,
    max_windows: int | None = None,
    methods: list[str] | None = None,
) -> list[dict]:
    options = GateOptions(eval_set=eval_set, max_windows=max_windows)
    methods = methods or [*METHODS, LLAMA_CPP]
    out = []
    if LLAMA_CPP in methods:
        source = full_precision_gguf(model, tmp / "full.gguf")
        out.append(_row("full precision (BF16)", "BF16", source, 0.0, model, options))
    for qtype in types or list(TYPES):
        bits, symmetric = TYPES[qtype]
        for method in [m for m in METHODS if m in methods]:
            path = tmp / f"{method}-{qtype}.gguf"
            weights = WeightScheme(bits=bits, group_size=32, symmetric=symmetric)
            start = time.perf_counter()
            quantize_model(model, path, QuantizeOptions(method=method, format="gguf", weights=weights))
            out.append(_row(f"optkit {method}", qtype, path, time.perf_counter() - start, model, options))
        if LLAMA_CPP not in methods:
            continue
        start = time.perf_counter()
        path = llama_cpp_quantize(source, tmp / f"llama-cpp-{qtype}.gguf", qtype)
        out.append(_row("llama.cpp quantize", qtype, path, time.perf_counter() - start, model, options))
    return out


def gptq_beats_rtn(results: list[dict], qtype: str = "Q4_0") -> str | None:
    """The issue's check, read off the table: GPTQ's file has lower perplexity in llama.cpp than RTN's."""
    ppl = {r["variant"]: r["ppl_artifact"] for r in results if r["type"] == qtype}
    if "optkit gptq" not in ppl or "optkit rtn" not in ppl:
        return None
    gptq, rtn = ppl["optkit gptq"], ppl["optkit rtn"]
    verdict = "yes" if gptq < rtn else "NO"
    return (
        f"GPTQ {qtype} perplexity in llama.cpp below RTN {qtype}: {verdict} "
        f"({gptq:.4f} vs {rtn:.4f}, {gptq / rtn - 1:+.2%})"
    )


def table(model: str, eval_set: str, results: list[dict]) -> Table:
    base, windows = results[0]["ppl_base"], results[0]["windows"]
    t = Table(
        title=f"GGUF through llama.cpp on {model} ({eval_set}, {windows} windows, "
        f"base perplexity {base:.4f} in transformers)"
    )
    columns = ("perplexity", "Δppl %", "vs llama.cpp", "mean KLD", "same top-1 %", "quantize s", "gate s")
    for column in ("variant", "type", *columns):
        t.add_column(column, justify="left" if column in ("variant", "type") else "right")
    reference = {r["type"]: r["ppl_artifact"] for r in results if r["variant"] == "llama.cpp quantize"}
    for r in results:
        ratio = f"{r['ppl_artifact'] / reference[r['type']]:.4f}" if r["type"] in reference else "-"
        t.add_row(
            r["variant"], r["type"], f"{r['ppl_artifact']:.4f}", f"{r['ppl_increase_pct']:+.2f}", ratio,
            f"{r['kld_mean']:.5f}", f"{r['top1_pct']:.2f}", f"{r['quantize_s']:.1f}", f"{r['gate_s']:.0f}",
        )  # fmt: skip
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--eval-set", default="heldout")
    parser.add_argument("--types", nargs="+", choices=list(TYPES), default=list(TYPES))
    parser.add_argument("--methods", nargs="+", choices=[*METHODS, LLAMA_CPP], default=None)
    parser.add_argument("--max-windows", type=int, default=None, help="gate on the first N windows (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: the idle cores)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kquants", action="store_true", help="the K-quant mixes against llama.cpp's quantizer's")
    parser.add_argument("--kquant-types", nargs="+", choices=gguf_kquants.K_MIXES, default=list(gguf_kquants.K_MIXES))
    parser.add_argument("--decode-runs", type=int, default=3, help="--kquants: alternated decode runs (0: none)")
    parser.add_argument("--work", type=Path, default=None, help="--kquants: keep the files here, reuse what is")
    parser.add_argument("--optkit-arg", action="append", help="--kquants: one more optkit quantize argument")
    parser.add_argument("--perplexity-tool", action="store_true", help="--kquants: llama-perplexity's numbers too")
    parser.add_argument("--tools", action="store_true", help="--kquants: llama-imatrix and llama-quantize binaries")
    args = parser.parse_args()
    threads = args.threads or idle_cores()
    set_cpu_threads(threads)
    os.environ["OPTKIT_LLAMA_CPP_THREADS"] = str(threads)
    if args.kquants:
        return kquants_main(args, threads)
    with tempfile.TemporaryDirectory() as tmp:
        results = rows(args.model, Path(tmp), args.eval_set, args.types, args.max_windows, args.methods)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        Console(width=140).print(table(args.model, args.eval_set, results))
        check = gptq_beats_rtn(results)
        if check:
            print(check)
        print(f"threads: {threads}")


def kquants_main(args, threads: int) -> None:
    if args.methods and LLAMA_CPP in args.methods:
        raise SystemExit("--kquants: llama.cpp's rows are always measured; --methods names optkit's methods")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        found = gguf_kquants.run(args, threads, work)
    found |= {"threads": threads, "llama_cpp_tools": llama_cpp_tools.version() if args.tools else None}
    if args.json:
        print(json.dumps(found, indent=2))
        return
    Console(width=180).print(gguf_kquants.table(args.model, found["rows"]))
    for line in gguf_kquants.check_lines(found["checks"], found["decode"]):
        print(line)
    tools = f"; llama.cpp's tools from llama-cpp-python {found['llama_cpp_tools']}" if args.tools else ""
    print(f"threads: {threads}{tools}")


if __name__ == "__main__":
    main()
