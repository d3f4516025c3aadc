"""The dry-run's peak-memory estimate (quant/plan.py) against measured runs.

    python bench/plan_memory.py                      # the default cases (below)
    python bench/plan_memory.py --cases small:gptq medium:awq --num-samples 64

For each case MODEL:METHOD it prints `optkit quantize MODEL --method METHOD --dry-run`'s expected
peak (part by part) and the peak RSS the real run records in its manifest (optkit.json
`peak_memory.rss_bytes`: peak RSS above the RSS at the pipeline's entry), with their ratio, twice,
each the first run of a fresh process as `optkit quantize` runs it:
  cold  glibc's default allocator, what a user's run records. Beside the live tensors it holds
        what a process pays once (transformers' modeling code imported, the tokenizer loaded,
        torch's set-up: ~10-30 MB whatever the model) and the heap pages glibc keeps after a
        free: its mmap threshold grows to the largest block freed, so later tensors up to that
        size come from the heap, whose freed pages stay resident;
  live  MALLOC_MMAP_THRESHOLD_=131072: every block over 128 KiB is mmapped and returned when
        freed, so the peak follows the live tensors (plus the once-per-process part).
Each case runs in its own subprocess (peak RSS is per process). Models: a zoo name (small,
small-moe), a family of tests/tiny_families.py (gemma2, phi3, ...), or `medium`, a random Llama
built here (hidden 1024, intermediate 2816, 2 layers: the decoder layer and the working set weigh
as much as the calibration inputs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_CASES = (
    "small:rtn",
    "small:gptq",
    "small:awq",
    "small:smoothquant",
    "small-moe:gptq",
    "gemma2:gptq",
    "medium:rtn",
    "medium:gptq",
    "medium:awq",
    "medium:smoothquant",
)
MEDIUM = dict(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
MiB = 2**20


def model_dir(name: str, scratch: Path) -> Path:
    """A model directory for `name` (built under `scratch` when it is not a zoo model)."""
    from optkit.modeldir import resolve_model_dir
    from tests.tiny_families import FAMILIES, save_tiny_family

    if name in FAMILIES:
        return save_tiny_family(name, scratch / name, resolve_model_dir("draft"))
    if name == "medium":
        return _save_medium(scratch / name, resolve_model_dir("small"))
    return resolve_model_dir(name)


def _save_medium(out: Path, tokenizer_dir: Path) -> Path:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MEDIUM, initializer_range=0.02)).to(torch.bfloat16)
    model.save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, out / file)
    return out


def options_for(method: str, num_samples: int, seq_len: int, grid: int):
    """The CLI's defaults, but AWQ's and SmoothQuant's search grids of `grid` points: a grid point
    reruns a block on the same captured inputs, so it costs time and no memory."""
    from optkit.quant.calibration_data import CalibrationOptions
    from optkit.quant.methods.awq.options import AWQOptions
    from optkit.quant.methods.smoothquant.options import SmoothQuantOptions
    from optkit.quant.quantize import QuantizeOptions
    from optkit.weights.schemes import W8_PER_CHANNEL

    weights = {"weights": W8_PER_CHANNEL} if method == "smoothquant" else {}
    return QuantizeOptions(
        method=method,
        calibration=CalibrationOptions(num_samples=num_samples, seq_len=seq_len),
        awq=AWQOptions(grid=grid),
        smoothquant=SmoothQuantOptions(alpha_grid=grid),
        **weights,
    )


def measure(model: Path, method: str, num_samples: int, seq_len: int, grid: int) -> dict:
    """In this (fresh) process: the plan's estimate and the run's recorded peak."""
    from optkit.quant.plan import plan_quantization
    from optkit.quant.quantize import quantize_model

    options = options_for(method, num_samples, seq_len, grid)
    estimate = plan_quantization(model, options).peak_bytes
    with tempfile.TemporaryDirectory() as tmp:
        manifest = quantize_model(model, Path(tmp) / "run", options)
    return {"estimate": estimate, "measured": manifest["peak_memory"]["rss_bytes"]}


def run_case(model: Path, method: str, args: argparse.Namespace, live: bool) -> dict:
    cmd = [sys.executable, __file__, "--_one", str(model), method, "--num-samples", str(args.num_samples)]
    cmd += ["--seq-len", str(args.seq_len), "--grid", str(args.grid)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"} if live else None
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="MODEL:METHOD ...")
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--grid", type=int, default=20, help="AWQ's and SmoothQuant's search grid (no memory)")
    parser.add_argument("--json", type=Path, help="also write the rows here (JSON lines)")
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)  # MODEL_DIR METHOD, in a subprocess
    args = parser.parse_args()
    if args._one:
        model, method = Path(args._one[0]), args._one[1]
        print(json.dumps(measure(model, method, args.num_samples, args.seq_len, args.grid)))
        return
    print(f"calibration {args.num_samples} x {args.seq_len} tokens, search grid {args.grid}; MiB")
    print("ratio = measured / estimate; cold: glibc's default malloc, live: MALLOC_MMAP_THRESHOLD_=131072")
    print(f"{'case':22s} {'estimate':>9s} {'cold':>7s} {'ratio':>6s} {'live':>7s} {'ratio':>6s}  estimate's parts")
    with tempfile.TemporaryDirectory() as scratch:
        models: dict[str, Path] = {}
        for case in args.cases:
            name, _, method = case.partition(":")
            if name not in models:
                models[name] = model_dir(name, Path(scratch))
            try:
                cold, live = (run_case(models[name], method, args, live) for live in (False, True))
            except RuntimeError as e:
                print(f"{case:22s} failed: {e}")
                continue
            est = cold["estimate"]["total"]
            parts = ", ".join(f"{k} {v / MiB:.1f}" for k, v in cold["estimate"].items() if k != "total")
            print(
                f"{case:22s} {est / MiB:9.1f} {cold['measured'] / MiB:7.1f} {cold['measured'] / est:6.2f} "
                f"{live['measured'] / MiB:7.1f} {live['measured'] / est:6.2f}  {parts}",
                flush=True,
            )
            if args.json:
                row = {"case": case, "estimate": cold["estimate"], "cold": cold["measured"], "live": live["measured"]}
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
