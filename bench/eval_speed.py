"""How long `optkit eval` takes on a W4A16 artifact against evaluating its base (issue 20: no slower).

Both run the gate on the same windows against the same cached reference (the base's top-k
log-probs, built once before timing), so each timed run loads and runs only the model under test:
  transformers  the default path: the artifact loaded by quant/formats/load.py (weights dequantized
                once at load), then transformers' forward
  runtime       `--kv-cache-dtype auto`: the runtime's model through paged attention (models/paged_lm.py);
                a W4A16 window (seq_len rows) takes PackedIntLinear's scratch dequantization + fp32 GEMM
The runs rotate within each repeat; the ratio is the median of base / W4A16 within each repeat
(>= 1.0: the W4A16 eval is no slower). The artifact is RTN W4A16 (group 64), cached under
$OPTKIT_CACHE/bench/eval_speed.

Usage: python bench/eval_speed.py [--model small] [--windows 16] [--seq-len 256] [--repeats 3] [--threads 1]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def artifact(model: str) -> Path:
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    root = Path(os.environ.get("OPTKIT_CACHE", Path.home() / ".cache" / "optkit")) / "bench" / "eval_speed"
    path = root / f"{Path(model).name}-w4a16-g64"
    if not (path / "config.json").exists():
        quantize_model(model, path, QuantizeOptions(weights=WeightScheme(bits=4, group_size=64)))
    return path


def main() -> None:
    args = parse_args()
    from optkit.devices import set_cpu_threads

    set_cpu_threads(args.threads)
    import torch

    from optkit.gate.evaluate import evaluate
    from optkit.gate.options import GateOptions
    from optkit.models.loader import load_runtime_model
    from optkit.models.paged_lm import PagedLM

    w4 = artifact(args.model)
    options = GateOptions(seq_len=args.seq_len, max_windows=args.windows, reference_cache=True)
    evaluate(args.model, args.model, options)  # builds the reference cache: no timed run loads the base twice

    def timed(path, runtime: bool) -> float:
        start = time.perf_counter()
        model = PagedLM(load_runtime_model(path, prepare=False)) if runtime else None  # as optkit eval does
        evaluate(path, args.model, options, artifact_model=model)
        return time.perf_counter() - start

    runs = {
        ("transformers", "base"): lambda: timed(args.model, False),
        ("transformers", "w4a16"): lambda: timed(w4, False),
        ("runtime", "base"): lambda: timed(args.model, True),
        ("runtime", "w4a16"): lambda: timed(w4, True),
    }
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(args.repeats):
        for key in names[r % len(names) :] + names[: r % len(names)]:
            samples[key].append(runs[key]())
            print(f"repeat {r + 1}/{args.repeats} {key[0]} {key[1]}: {samples[key][-1]:.2f} s", file=sys.stderr)
    print(
        f"{args.model}, {args.windows} windows of {args.seq_len} tokens, {torch.get_num_threads()} thread(s), "
        f"medians of {args.repeats} interleaved repeats:"
    )
    print("| path | base s | W4A16 s | base / W4A16 (>= 1.0: no slower) |")
    print("|---|---|---|---|")
    for path in ("transformers", "runtime"):
        base, quant = samples[(path, "base")], samples[(path, "w4a16")]
        ratio = statistics.median(b / q for b, q in zip(base, quant, strict=True))
        print(f"| {path} | {statistics.median(base):.2f} | {statistics.median(quant):.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
