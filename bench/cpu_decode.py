"""CPU decode speed of full precision (fp32, bf16), RTN W4A16 and W8A8, and transformers `generate`,
side by side in one run, on two random-weight Llama shapes (issue 20):
  (a) decoder-dominated: hidden 768, 12 layers, MLP 2048, 12 heads, vocabulary 4,096, tied
  (b) a real small-model shape: hidden 576, 30 layers, MLP 1536, GQA 9/3, vocabulary 49,152, tied
      (its output head is a fifth of the fp32 bytes)
Batch 1: one 64-token prompt, 32 new tokens. Batch 16: mixed prompt lengths (16-64), 32 new tokens
each (transformers: left-padded). Every figure is the median of interleaved repeats (the runs rotate
within each repeat); ratios against fp32 are medians of the ratios within each repeat. Also the
engine's per-step overhead (wall time of a step minus the time inside the model, median over 100
decode steps at batch 1) and the kernel each quantized layer takes. With llama-cpp-python installed,
llama.cpp decodes the Q4_0 GGUF of the same weights (symmetric 4-bit g32, `--format gguf`; the tied
embedding/head stays fp32 as optkit writes it) with the same prompts, new tokens and thread count
(bench/llama_cpp_decode.py). Models are built and quantized once, cached under
$OPTKIT_CACHE/bench/cpu_decode. `--isa avx2` reruns under ATEN_CPU_CAPABILITY=avx2 (a CPU without
AVX-512; llama.cpp is left out there: ggml picks its own instructions).

Usage: python bench/cpu_decode.py [--quick] [--threads N] [--repeats 3] [--head int8] [--isa avx2] [--json out.json]
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # bench/llama_cpp_decode.py

SHAPES = {
    "a": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12,
              num_key_value_heads=12, vocab_size=4096),
    "b": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
              num_key_value_heads=3, vocab_size=49152),
}  # fmt: skip
PROMPT_LEN, GEN_LEN, BATCH, MIXED = 64, 32, 16, (16, 64)
OVERHEAD_STEPS = 100
MAX_MODEL_LEN = PROMPT_LEN + OVERHEAD_STEPS + 8
RUNS = ("fp32", "bf16", "w4a16", "w8a8", "transformers", "llama.cpp")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shape (a) only, one repeat, 8 new tokens, 20 steps")
    p.add_argument("--shapes", default="a,b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--head", default="int8", choices=["full", "int8", "int4"],
        help="output head of the quantized artifacts (optkit quantize --head; W8A8 takes full or int8)",
    )  # fmt: skip
    p.add_argument("--group-size", type=int, default=64, help="W4A16 group size (64 divides both shapes)")
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--markdown", type=Path, default=None, help="render a --json result as Markdown tables and exit")
    return p.parse_args()


def cache_dir() -> Path:
    return Path(os.environ.get("OPTKIT_CACHE", Path.home() / ".cache" / "optkit")) / "bench" / "cpu_decode"


def build(shape: str, group_size: int, log, head: str = "full") -> dict[str, Path]:
    """The random base model and its RTN W4A16 and W8A8 artifacts with `head` (built once, then cached)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from optkit.modeldir import resolve_model_dir
    from optkit.quant.calibration_data import CalibrationOptions
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import W8_PER_CHANNEL, WeightScheme

    root = cache_dir() / shape
    w8a8_head = "int8" if head == "int8" else "full"
    paths = {
        "base": root / "base",
        "w4a16": root / f"w4a16-g{group_size}-head-{head}",
        "w8a8": root / f"w8a8-head-{w8a8_head}",
    }
    paths["q4_0"] = root / "q4_0.gguf"
    if not (paths["base"] / "config.json").exists():
        log(f"shape ({shape}): building the random model")
        torch.manual_seed(0)
        config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=512)
        model = LlamaForCausalLM(config).eval()
        tmp = root / "base.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer = resolve_model_dir("small")  # the reference tokenizer (4,096 ids) for calibration text
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / file, tmp / file)
        tmp.rename(paths["base"])
    calibration = CalibrationOptions(num_samples=8, seq_len=64)
    options = {
        "w4a16": QuantizeOptions(weights=WeightScheme(bits=4, group_size=group_size), head=head),
        "w8a8": QuantizeOptions(method="w8a8", weights=W8_PER_CHANNEL, calibration=calibration, head=w8a8_head),
    }
    for name, opts in options.items():
        if not (paths[name] / "config.json").exists():
            log(f"shape ({shape}): quantizing {name}")
            quantize_model(str(paths["base"]), paths[name], opts)
    if llama_cpp_installed() and not paths["q4_0"].exists():
        log(f"shape ({shape}): writing the Q4_0 GGUF")
        quantize_model(
            str(paths["base"]),
            paths["q4_0"],
            QuantizeOptions(weights=WeightScheme(bits=4, group_size=32), format="gguf"),
        )
    return paths


def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def engine(path: Path, dtype: str):
    from optkit.runtime.engine import EngineConfig, LLMEngine

    config = EngineConfig(
        max_num_seqs=BATCH, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN, dtype=dtype,
        device="cpu", kv_cache_blocks=BATCH * (MAX_MODEL_LEN // 16 + 1), enable_prefix_caching=False,
    )  # fmt: skip
    return LLMEngine(path, config)


def run_engine(e, prompts: list[list[int]], gen_len: int) -> float:
    from optkit.runtime.sequence import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = e.generate(prompts, params)
    wall = time.perf_counter() - start
    assert all(len(o) == gen_len for o in outputs)
    return len(prompts) * gen_len / wall


def run_hf(model, prompts: list[list[int]], gen_len: int) -> float:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, pad_token_id=0
        )
        wall = time.perf_counter() - start
    assert out.shape[1] == width + gen_len
    return len(prompts) * gen_len / wall


def run_llama_cpp(decoder, prompts: list[list[int]], gen_len: int) -> float:
    start = time.perf_counter()
    outputs = decoder.generate(prompts, gen_len)
    wall = time.perf_counter() - start
    assert all(len(o) == gen_len for o in outputs)
    return len(prompts) * gen_len / wall


def kernels_of(model) -> dict[str, int]:
    """How many quantized layers take each path at one row (decode)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if hasattr(m, "kernel_for"):
            name = m.kernel_for("cpu", 1)
        elif type(m).__name__ == "W8A8Linear":
            name = "torch._int_mm (oneDNN), column-major int8 weight"
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def bench_shape(shape: str, args, log) -> dict:
    import torch

    from optkit.runtime.benchmark import load_hf, step_overhead

    paths = build(shape, args.group_size, log, args.head)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(0)
    gen_len = 8 if args.quick else GEN_LEN
    one = [[rng.randrange(vocab) for _ in range(PROMPT_LEN)]]
    mixed = [[rng.randrange(vocab) for _ in range(rng.randint(*MIXED))] for _ in range(BATCH)]
    engines = {
        "fp32": engine(paths["base"], "float32"),
        "bf16": engine(paths["base"], "bfloat16"),
        "w4a16": engine(paths["w4a16"], "float32"),
        "w8a8": engine(paths["w8a8"], "float32"),
    }
    hf = load_hf(paths["base"], torch.float32, "cpu")
    runners = {name: (lambda p, e=e: run_engine(e, p, gen_len)) for name, e in engines.items()}
    runners["transformers"] = lambda p: run_hf(hf, p, gen_len)
    if args.isa == "native" and paths["q4_0"].exists():
        from llama_cpp_decode import LlamaCppDecoder

        decoder = LlamaCppDecoder(str(paths["q4_0"]), BATCH, MAX_MODEL_LEN, torch.get_num_threads())
        runners["llama.cpp"] = lambda p: run_llama_cpp(decoder, p, gen_len)
    for run in runners.values():  # warm-up: first-call costs are not throughput
        run([one[0][:8]])
    samples: dict[tuple[str, int], list[float]] = {}
    repeats = 1 if args.quick else args.repeats
    for r in range(repeats):
        order = list(runners)[r % len(runners) :] + list(runners)[: r % len(runners)]  # rotate
        for batch, prompts in ((1, one), (BATCH, mixed)):
            for name in order:
                tps = runners[name](prompts)
                samples.setdefault((name, batch), []).append(tps)
                log(f"shape ({shape}) repeat {r + 1}/{repeats} batch {batch} {name}: {tps:.1f} tok/s")
    rows = []
    for batch in (1, BATCH):
        for name in runners:
            tps = samples[(name, batch)]
            rows.append({"run": name, "batch": batch, "tokens_per_s": statistics.median(tps),
                         "vs_fp32": paired_ratio(tps, samples[("fp32", batch)]), "samples": tps})  # fmt: skip
    steps = 20 if args.quick else OVERHEAD_STEPS
    overhead = {name: step_overhead(e, one[0], steps) for name, e in engines.items()}
    for name, o in overhead.items():
        log(f"shape ({shape}) {name}: step {o['step_s'] * 1e3:.2f} ms, overhead {o['overhead_share']:.1%}")
    kernels = {name: kernels_of(e.model) for name, e in engines.items() if name in ("w4a16", "w8a8")}
    from optkit.runtime.benchmark import decode_operators

    operators = {name: decode_operators(e.model, "cpu") for name, e in engines.items()}
    return {"rows": rows, "overhead": overhead, "kernels": kernels, "decode_operators": operators}


def paired_ratio(runs: list[float], baseline: list[float]) -> float:
    """The median over repeats of run / baseline within the same repeat: the runs of one repeat are
    minutes apart, so the machine's load (shared, and changing by 3x over a bench) mostly cancels."""
    return statistics.median(r / b for r, b in zip(runs, baseline, strict=True))


def ratio(result: dict, shape: str, run: str, batch: int, against: str) -> float | None:
    rows = result.get(shape, {}).get("rows", [])
    get = {(r["run"], r["batch"]): r["samples"] for r in rows}
    if (run, batch) not in get or (against, batch) not in get:
        return None
    return paired_ratio(get[(run, batch)], get[(against, batch)])


def targets(result: dict, isa: str) -> list[tuple[str, float | None, float]]:
    """(what, measured, target) for each target of issue 20 this run measures."""
    if isa == "avx2":  # never slower: no quantized path under fp32 without AVX-512
        return [
            (f"{run} batch {b}, shape ({s}), vs fp32 (AVX2)", ratio(result, s, run, b, "fp32"), 1.0)
            for s in result for run in ("w4a16", "w8a8") for b in (1, BATCH)
        ]  # fmt: skip
    out = [
        ("W4A16 batch 1, shape (a), vs fp32", ratio(result, "a", "w4a16", 1, "fp32"), 3.0),
        ("W4A16 batch 1, shape (a), vs bf16", ratio(result, "a", "w4a16", 1, "bf16"), 1.5),
        ("W4A16 batch 1, shape (b), vs fp32", ratio(result, "b", "w4a16", 1, "fp32"), 2.0),
    ]
    for s in result:
        out.append((f"W8A8 batch 1, shape ({s}), vs fp32", ratio(result, s, "w8a8", 1, "fp32"), 1.5))
        out.append((f"bf16 batch 1, shape ({s}), vs fp32", ratio(result, s, "bf16", 1, "fp32"), 1.0))
        out.append((f"engine fp32 vs transformers, batch {BATCH} mixed, shape ({s})",
                    ratio(result, s, "fp32", BATCH, "transformers"), 1.2))  # fmt: skip
    for s in result:
        for b, goal in ((1, 0.8), (BATCH, 1.0)):
            out.append(
                (f"W4A16 vs llama.cpp Q4_0, batch {b}, shape ({s})", ratio(result, s, "w4a16", b, "llama.cpp"), goal)
            )
    if "b" in result:
        share = result["b"]["overhead"]["fp32"]["overhead_share"]
        out.append(("per-step overhead, batch 1, shape (b), fp32 (at most)", share, 0.10))
    return [t for t in out if t[1] is not None]


def passed(what: str, measured: float, target: float) -> bool:
    return measured <= target if "at most" in what else measured >= target


def markdown(payload: dict) -> str:
    """The result as the Markdown tables of docs/results.md."""
    meta, lines = payload["meta"], []
    for shape, r in payload["shapes"].items():
        by = {(row["run"], row["batch"]): row for row in r["rows"]}
        lines += [f"Shape ({shape}), {meta['cpu_capability']}, {meta['threads']} thread(s), head {meta['head']}, "
                  f"medians of {meta['repeats']} interleaved repeats:", "",
                  f"| run | batch 1 tok/s | vs fp32 | batch {BATCH} tok/s (mixed prompts) | vs fp32 | step overhead |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for run in (run for run in RUNS if (run, 1) in by):
            o = r["overhead"].get(run)
            cells = [run]
            for b in (1, BATCH):
                cells += [f"{by[(run, b)]['tokens_per_s']:.1f}", f"{by[(run, b)]['vs_fp32']:.2f}x"]
            cells.append(f"{o['overhead_share']:.1%} of {o['step_s'] * 1e3:.1f} ms" if o else "")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["| target | measured | goal | verdict |", "|---|---|---|---|"]
    for t in payload["targets"]:
        share = "at most" in t["what"]
        shown = f"{t['measured']:.1%}" if share else f"{t['measured']:.2f}x"
        goal = f"<= {t['target']:.0%}" if share else f">= {t['target']:.1f}x"
        lines.append(f"| {t['what']} | {shown} | {goal} | {'PASS' if t['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    if args.isa == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})
    import torch
    from rich.console import Console
    from rich.table import Table

    from optkit.devices import set_cpu_threads

    set_cpu_threads(args.threads)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    shapes = ["a"] if args.quick else args.shapes.split(",")
    result = {shape: bench_shape(shape, args, log) for shape in shapes}
    checks = targets(result, args.isa)
    meta = {
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), "head": args.head, "group_size": args.group_size,
        "repeats": 1 if args.quick else args.repeats, "quick": args.quick,
    }  # fmt: skip
    console = Console(soft_wrap=True)
    for shape, r in result.items():
        table = Table(title=f"shape ({shape}), {meta['cpu_capability']}, {meta['threads']} threads, head {args.head}")
        for column in ("run", "batch 1 tok/s", "vs fp32", f"batch {BATCH} tok/s", "vs fp32 ", "step overhead"):
            table.add_column(column, justify="left" if column == "run" else "right")
        by = {(row["run"], row["batch"]): row for row in r["rows"]}
        for run in (run for run in RUNS if (run, 1) in by):
            o = r["overhead"].get(run)
            cells = [run]
            for b in (1, BATCH):
                cells += [f"{by[(run, b)]['tokens_per_s']:.1f}", f"{by[(run, b)]['vs_fp32']:.2f}x"]
            cells.append(f"{o['overhead_share']:.1%} of {o['step_s'] * 1e3:.1f} ms" if o else "")
            table.add_row(*cells)
        console.print(table)
        for run, kernels in r["kernels"].items():
            console.print(f"  {run} layers: " + "; ".join(f"{n} x{c}" for n, c in kernels.items()))
        for run, operators in r.get("decode_operators", {}).items():
            console.print(f"  {run} RMSNorm, RoPE, decode attention: {operators}")
    targets_table = Table(title="targets (issue 20)")
    for column in ("what", "measured", "target", "verdict"):
        targets_table.add_column(column)
    for what, measured, target in checks:
        share = "at most" in what
        shown = f"{measured:.1%}" if share else f"{measured:.2f}x"
        goal = f"<= {target:.0%}" if share else f">= {target:.1f}x"
        targets_table.add_row(what, shown, goal, "PASS" if passed(what, measured, target) else "FAIL")
    console.print(targets_table)
    if args.json:
        payload = {"meta": meta, "shapes": result, "targets": [
            {"what": w, "measured": m, "target": t, "pass": passed(w, m, t)} for w, m, t in checks]}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
