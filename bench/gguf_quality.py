"""GGUF rows of the quality benchmark: RTN, GPTQ and AWQ written as llama.cpp's Q4_0, Q4_1 and Q8_0,
and llama.cpp's own quantizer at the same type, all measured by the same gate through llama.cpp.

Every row is an `optkit eval model.gguf --baseline MODEL` (heldout, full-vocabulary KLD): llama.cpp
computes the artifact's logits, transformers the base's. Two reference rows are measured in the same
run: the full-precision model written as GGUF (llama.cpp's own error with unquantized weights) and,
per type, llama.cpp's quantizer (llama_model_quantize, round to nearest with its own scale choice) on
that file, with token_embd and output kept at the base dtype as optkit keeps them.

Usage: python bench/gguf_quality.py [--model small] [--types Q4_0 Q4_1 Q8_0] [--json]
(needs the extra: pip install 'optkit[gguf]'). bench/quant_quality.py --gguf prints the same table.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

TYPES = {"Q4_0": (4, True), "Q4_1": (4, False), "Q8_0": (8, True)}
METHODS = ("rtn", "gptq", "awq")


def _gate(path: Path, model: str, eval_set: str) -> dict:
    m = evaluate(path, model, GateOptions(eval_set=eval_set)).metrics
    keys = ("ppl_artifact", "ppl_base", "ppl_increase_pct", "kld_mean", "top1_pct")
    return {k: m[k] for k in keys}


def full_precision_gguf(model: str, out: Path) -> Path:
    """The model as GGUF with no layer quantized (every linear ignored): the input of llama.cpp's quantizer."""
    options = QuantizeOptions(method="rtn", format="gguf", ignore=["*"], weights=WeightScheme(group_size=32))
    quantize_model(model, out, options)
    return out


def llama_cpp_quantize(source: Path, out: Path, qtype: str) -> Path:
    """llama.cpp's own quantizer on `source`, embeddings and output left at their dtype."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.token_embedding_type = llama_cpp.GGML_TYPE_BF16
    params.output_tensor_type = llama_cpp.GGML_TYPE_BF16
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    return out


def _row(variant: str, qtype: str, path: Path, seconds: float, model: str, eval_set: str) -> dict:
    return {"variant": variant, "type": qtype, "quantize_s": seconds, **_gate(path, model, eval_set)}


def rows(model: str, tmp: Path, eval_set: str = "heldout", types: list[str] | None = None) -> list[dict]:
    source = full_precision_gguf(model, tmp / "full.gguf")
    out = [_row("full precision (BF16)", "BF16", source, 0.0, model, eval_set)]
    for qtype in types or list(TYPES):
        bits, symmetric = TYPES[qtype]
        for method in METHODS:
            path = tmp / f"{method}-{qtype}.gguf"
            weights = WeightScheme(bits=bits, group_size=32, symmetric=symmetric)
            start = time.perf_counter()
            quantize_model(model, path, QuantizeOptions(method=method, format="gguf", weights=weights))
            out.append(_row(f"optkit {method}", qtype, path, time.perf_counter() - start, model, eval_set))
        start = time.perf_counter()
        path = llama_cpp_quantize(source, tmp / f"llama-cpp-{qtype}.gguf", qtype)
        out.append(_row("llama.cpp quantize", qtype, path, time.perf_counter() - start, model, eval_set))
    return out


def table(model: str, eval_set: str, results: list[dict]) -> Table:
    base = results[0]["ppl_base"]
    t = Table(title=f"GGUF through llama.cpp on {model} ({eval_set}, base perplexity {base:.3f} in transformers)")
    for column in ("variant", "type", "perplexity", "Δppl %", "vs llama.cpp", "mean KLD", "same top-1 %", "s"):
        t.add_column(column, justify="left" if column in ("variant", "type") else "right")
    reference = {r["type"]: r["ppl_artifact"] for r in results if r["variant"] == "llama.cpp quantize"}
    for r in results:
        ratio = f"{r['ppl_artifact'] / reference[r['type']]:.4f}" if r["type"] in reference else "-"
        t.add_row(
            r["variant"], r["type"], f"{r['ppl_artifact']:.4f}", f"{r['ppl_increase_pct']:+.2f}", ratio,
            f"{r['kld_mean']:.5f}", f"{r['top1_pct']:.2f}", f"{r['quantize_s']:.1f}",
        )  # fmt: skip
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--eval-set", default="heldout")
    parser.add_argument("--types", nargs="+", choices=list(TYPES), default=list(TYPES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = rows(args.model, Path(tmp), args.eval_set, args.types)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        Console(width=140).print(table(args.model, args.eval_set, results))


if __name__ == "__main__":
    main()
