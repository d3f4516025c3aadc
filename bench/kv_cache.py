"""The 8-bit KV cache against the model's own dtype, in one run: quality through the runtime's paged
attention, bytes per token, and how many sequences a fixed --kv-cache-blocks holds.

Quality: the gate (optkit eval --kv-cache-dtype) on each KV cache dtype, written two ways: `prefill`,
every window one prefill whose keys and values are written to the cache (whole blocks at once) and
read back from it; `decode`, the windows of a batch run one token per step, so each block's scale
grows and requantizes its rows as decode writes them, and each token reads the cache as it stood at
its step. The gate's baseline is the same model through transformers (no paged cache), so each
`auto` row is the runtime's own numerical difference and the int8/fp8 rows, compared with the
`auto` row written the same way, add the cache's. Capacity: engines at a fixed --kv-cache-blocks
(bfloat16, as served) admit identical 3-block requests; the peak of running sequences is counted.

Usage: python bench/kv_cache.py [--model small] [--max-windows N] [--decode-windows N] [--json]
(on a loaded machine OMP_NUM_THREADS=1 keeps the decode rows' thousands of small steps fast)
"""

import argparse
import json

from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.modeldir import load_tokenizer, resolve_model_dir
from optkit.models.loader import load_runtime_model
from optkit.models.paged_lm import PagedLM
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams

DTYPES = ("auto", "int8", "fp8")


def quality(model: str, max_windows: int | None, chunk_size: int | None) -> list[dict]:
    """Gate metrics per KV cache dtype; chunk_size None: whole-window prefill, 1: decode-like writes."""
    path = resolve_model_dir(model)
    runtime = load_runtime_model(path)
    rows = []
    for kv_dtype in DTYPES:
        artifact = PagedLM(runtime, kv_dtype, chunk_size=chunk_size)
        metrics = evaluate(path, path, GateOptions(max_windows=max_windows), artifact_model=artifact)
        rows.append({"kv_cache_dtype": kv_dtype, "writes": "prefill" if chunk_size is None else "decode",
                     "max_windows": max_windows, **{k: metrics.metrics[k] for k in ("ppl_base", "ppl_artifact",
                     "ppl_increase_pct", "kld_mean", "top1_pct")}})  # fmt: skip
    auto = rows[0]["ppl_artifact"]
    for row in rows:  # against the same model with its own-dtype (fp32) cache written the same way, in this run
        row["ppl_vs_auto_pct"] = 100 * (row["ppl_artifact"] / auto - 1)
    return rows


def capacity(model: str, blocks: int) -> list[dict]:
    path = resolve_model_dir(model)
    ids = load_tokenizer(path).encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 400))
    prompts = [ids[i * 50 : i * 50 + 46] for i in range(32)]  # with 2 new tokens: 3 blocks of 16 each
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rows = []
    for kv_dtype in DTYPES:
        config = EngineConfig(dtype="bfloat16", kv_cache_blocks=blocks, max_num_seqs=32,
                              max_num_batched_tokens=4096, kv_cache_dtype=kv_dtype)  # fmt: skip
        engine = LLMEngine(path, config)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, f"r{i}")
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.stats().num_running)
        stats = engine.stats()
        rows.append({"kv_cache_dtype": kv_dtype, "kv_cache_blocks": blocks, "num_kv_blocks": stats.num_kv_blocks,
                     "bytes_per_token": stats.kv_cache_bytes_per_token, "peak_running": peak})  # fmt: skip
    for row in rows:
        row["sequences_vs_auto"] = row["peak_running"] / rows[0]["peak_running"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=24, help="--kv-cache-blocks of the capacity rows")
    parser.add_argument(
        "--capacity-model", default="draft", help="the model of the capacity rows (bf16 on CPU is slow)"
    )
    parser.add_argument(
        "--decode-windows", type=int, default=None, help="windows of the decode-like rows (default: --max-windows)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    decode_windows = args.decode_windows or args.max_windows
    result = {
        "capacity": capacity(args.capacity_model, args.blocks),
        "quality": quality(args.model, args.max_windows, None) + quality(args.model, decode_windows, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for r in result["capacity"]:
        print(
            f"{r['kv_cache_dtype']:>5}: --kv-cache-blocks {r['kv_cache_blocks']} -> {r['num_kv_blocks']} blocks, "
            f"{r['bytes_per_token']:g} B/token, peak {r['peak_running']} running ({r['sequences_vs_auto']:.2f}x)"
        )
    for r in result["quality"]:
        print(
            f"{r['kv_cache_dtype']:>5} {r['writes']:>7} writes: ppl {r['ppl_artifact']:.4f} "
            f"(transformers {r['ppl_base']:.4f}), "
            f"vs auto {r['ppl_vs_auto_pct']:+.3f}%, mean KLD {r['kld_mean']:.6f}, top-1 {r['top1_pct']:.2f}%"
        )


if __name__ == "__main__":
    main()
