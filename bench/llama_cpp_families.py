"""The compatibility matrix's llama.cpp column on every family × file type, measured on briefly trained
models (issue 34): random models cannot hold the strict line (their top tokens are near ties that
llama.cpp's 8-bit activations flip), trained ones have peaked next-token distributions.

Per family: a tiny model of its own transformers class (2 layers, hidden 256, heads of 64, MLPs of
512, experts of 256: every width a multiple of 256, so no tensor falls back off a K type) trained by
the zoo's trainer (optkit/zoo/train.py: the reference tokenizer, data and recipe) for STEPS steps of
8 × 128 tokens, cached by content under $OPTKIT_CACHE/zoo-families. Per file type: `optkit quantize
--method rtn --format gguf --gguf-type T`, the manifest checked for fallbacks, then llama.cpp on the
file against optkit's runtime on the file's own dequantized weights, on the first WINDOWS heldout
windows: the strict line (optkit/gate/llama_cpp_agreement.py: same top token ≥ 98%, perplexity
within 1%).

Usage: OMP_NUM_THREADS=1 python bench/llama_cpp_families.py [--families llama gemma2 ...]
[--types Q8_0 Q4_K_M ...] [--results cells.jsonl (the matrix cells, for bench/compat_matrix.py
--results cells.jsonl --keep docs/compatibility.md)] [--threads 1] [--json]
"""

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import gguf
import torch

from optkit.cache import cache_dir
from optkit.compat import matrix
from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.devices import set_cpu_threads
from optkit.gate.llama_cpp_agreement import llama_cpp_agreement
from optkit.modeldir import load_tokenizer
from optkit.quant.formats.gguf_mix import linear_scheme
from optkit.quant.formats.gguf_weights import write_reference_dir
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.kquants import K_TYPES
from optkit.zoo.specs import ZooSpec
from optkit.zoo.train import build_reference_model

FILE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_L", "Q3_K_M", "Q3_K_S")
FILE_TYPES += ("Q2_K",)
STEPS, WINDOWS, WINDOW = 300, 32, 128
HEADS = {"head_dim": 64}
GEMMA = {**HEADS, "query_pre_attn_scalar": 64}
# per family: its model_type, config keys on its config class's defaults, experts (count, per token)
FAMILIES = {
    "llama": ("llama", {}, None),
    "mistral": ("mistral", {"sliding_window": None}, None),
    "qwen2": ("qwen2", {}, None),
    "qwen3": ("qwen3", HEADS, None),
    # Granite 3's 2B multipliers (heads of 64)
    "granite": (
        "granite",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
            "logits_scaling": 8.0,
        },
        None,
    ),  # fmt: skip
    "olmo2": ("olmo2", {"num_key_value_heads": 4}, None),
    # LongRoPE factors written; the 128-token windows lie within the original context (short factors)
    "phi3": (
        "phi3",
        {
            "original_max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0 + 0.02 * i for i in range(32)],
                "long_factor": [1.0 + 0.5 * i for i in range(32)],
            },
        },
        None,
    ),  # fmt: skip
    # sliding windows of 64 (< the 128-token windows), Gemma 2's soft-caps, Gemma 3's local RoPE base
    "gemma2": ("gemma2", {**GEMMA, "sliding_window": 64}, None),
    "gemma3_text": (
        "gemma3_text",
        {**GEMMA, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
        None,
    ),
    "gemma3": ("gemma3", {**GEMMA, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}, None),
    "mixtral": ("mixtral", {}, (4, 2)),
    "qwen2_moe": ("qwen2_moe", {"shared_expert_intermediate_size": 512}, (4, 2)),
    "qwen3_moe": ("qwen3_moe", {**HEADS, "norm_topk_prob": True}, (4, 2)),
}


def family_spec(family: str, steps: int = STEPS) -> ZooSpec:
    model_type, config, experts = FAMILIES[family]
    sizes = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)
    if experts:
        sizes |= dict(intermediate_size=256, num_experts=experts[0], experts_per_token=experts[1])
    recipe = dict(steps=steps, seq_len=WINDOW, batch_size=8)
    return ZooSpec(f"tiny-{family}", **sizes, **recipe, model_type=model_type, config=config)


def trained_model(family: str, steps: int = STEPS) -> tuple[Path, dict]:
    """The family's trained model (built once per content: the spec and the library versions)."""
    import transformers

    spec = family_spec(family, steps)
    key = json.dumps([dataclasses.asdict(spec), transformers.__version__, torch.__version__], sort_keys=True)
    path = cache_dir("zoo-families") / f"{family}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    info = path / "build.json"
    if not info.exists():
        result = build_reference_model(spec, path / "model", overwrite=True)
        info.write_text(json.dumps({"heldout_perplexity": result.heldout_perplexity, "seconds": result.seconds}))
    return path / "model", json.loads(info.read_text())


def fallbacks(path: Path, file_type: str) -> list[str]:
    """The linears a file type's mix put off its own types (a K mix: off the K types)."""
    manifest = json.loads(gguf.GGUFReader(path).fields["optkit.manifest"].contents())
    allowed = set(K_TYPES) if "_K" in file_type else {file_type}
    return [layer.get("name", "?") for layer in manifest["layers"] if layer["gguf_type"] not in allowed]


def cell(family: str, file_type: str, model: Path, tokens: torch.Tensor, work: Path) -> dict:
    path = work / f"{family}-{file_type}.gguf"
    quantize_model(model, path, QuantizeOptions(method="rtn", format="gguf", gguf={"type": file_type}))
    off = fallbacks(path, file_type)
    reference = write_reference_dir(path, model, work / f"{family}-{file_type}-ref")
    agreement = llama_cpp_agreement(path, tokens, reference)
    shutil.rmtree(reference)
    path.unlink()
    holds = agreement.holds and not off
    out = {"family": family, "type": file_type, "holds": holds, "fallbacks": off, **dataclasses.asdict(agreement)}
    return out | {"ppl_ratio": agreement.ppl_ratio}


def matrix_cells(row: dict) -> list[dict]:
    """A cell that holds the line, as the compatibility tests record it: llama.cpp loads it, nothing
    else reads it (a cell short of the line is printed, not recorded: docs/results.md names them)."""
    if not row["holds"]:
        return []
    scheme = linear_scheme(row["type"])
    scheme = scheme if isinstance(scheme, dict) else scheme.model_dump()
    versions = {p: matrix.installed_version(p) for p in ("transformers", "compressed-tensors", "torch", "gptqmodel")}
    versions["llama-cpp-python"] = matrix.installed_version("llama-cpp-python")
    base = {"row": f"{row['family']} (tiny, trained)", "method": "rtn", "kind": f"gguf {row['type']}", "format": "gguf"}
    base |= dict(versions=versions, bits=scheme["bits"], symmetric=scheme["symmetric"], w8a8=False, type="int")
    others = (matrix.OPTKIT, matrix.TRANSFORMERS, matrix.GPTQMODEL, matrix.VLLM)
    llama_cpp = {**base, "loader": matrix.LLAMA_CPP, "status": "loads"}
    return [llama_cpp, *({**base, "loader": loader, "status": "no"} for loader in others)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--types", nargs="+", choices=FILE_TYPES, default=list(FILE_TYPES))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--results", type=Path, help="append the matrix cells (JSON lines) to this file")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    set_cpu_threads(args.threads)
    os.environ["OPTKIT_LLAMA_CPP_THREADS"] = str(args.threads)
    rows, builds = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            start = time.perf_counter()
            model, builds[family] = trained_model(family, args.steps)
            texts = load_text_set("heldout").texts
            tokens = pack_windows(tokenize_stream(load_tokenizer(model), texts), WINDOW, WINDOWS)
            print(f"{family}: heldout ppl {builds[family]['heldout_perplexity']:.2f}", file=sys.stderr)
            for file_type in args.types:
                row = cell(family, file_type, model, tokens, Path(tmp))
                rows.append(row)
                print(f"row {json.dumps(row)}", file=sys.stderr)  # a crash later loses no measured row
                if args.results:
                    with open(args.results, "a") as f:
                        f.writelines(json.dumps(c, sort_keys=True) + "\n" for c in matrix_cells(row))
            builds[family]["cells_s"] = time.perf_counter() - start
    if args.json:
        print(json.dumps({"builds": builds, "rows": rows}, indent=2))
        return
    held = sum(r["holds"] for r in rows)
    for r in rows:
        mark = "holds" if r["holds"] else "SHORT"
        print(f"{r['family']:12} {r['type']:7} top {r['same_top']:.2%}  ppl {r['ppl_ratio'] - 1:+.3%}  {mark}")
    print(f"{held} of {len(rows)} cells hold the strict line (steps {args.steps}, {WINDOWS} windows of {WINDOW})")


if __name__ == "__main__":
    main()
