"""Quality of each quantization method on a reference model, measured in one run.

Prints method × bits × group size -> perplexity, Δppl %, mean KLD, same-top-token %, wall time.
Usage: python bench/quant_quality.py [--model small] [--bits 8 4 3 2] [--group-sizes 128 32] [--json]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from optkit.gate.evaluate import evaluate
from optkit.gate.thresholds import Thresholds
from optkit.quant.quantize import METHODS, QuantizeOptions, quantize_model
from optkit.quant.schemes import WeightScheme


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--bits", nargs="+", type=int, default=[8, 4, 3, 2])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[128, 32])
    parser.add_argument("--eval-set", default="heldout")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bits in args.bits:
            for group_size in args.group_sizes:
                for method in args.methods:
                    out = Path(tmp) / f"{method}-w{bits}-g{group_size}"
                    start = time.perf_counter()
                    options = QuantizeOptions(method=method, weights=WeightScheme(bits=bits, group_size=group_size))
                    quantize_model(args.model, out, options)
                    seconds = time.perf_counter() - start
                    m = evaluate(out, args.model, Thresholds(), eval_set=args.eval_set).metrics
                    rows.append(
                        {
                            "method": method,
                            "bits": bits,
                            "group_size": group_size,
                            "ppl": m["ppl_artifact"],
                            "ppl_base": m["ppl_base"],
                            "ppl_increase_pct": m["ppl_increase_pct"],
                            "kld_mean": m["kld_mean"],
                            "top1_pct": m["top1_pct"],
                            "quantize_s": seconds,
                        }
                    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(
        title=f"quantization quality on {args.model} ({args.eval_set}; base perplexity {rows[0]['ppl_base']:.3f})"
    )
    for column in ("method", "bits", "group", "perplexity", "Δppl %", "mean KLD", "same top-1 %", "quantize s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["method"],
            str(r["bits"]),
            str(r["group_size"]),
            f"{r['ppl']:.3f}",
            f"{r['ppl_increase_pct']:+.2f}",
            f"{r['kld_mean']:.4f}",
            f"{r['top1_pct']:.1f}",
            f"{r['quantize_s']:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
