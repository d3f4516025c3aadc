"""Sliding windows on Gemma's mixed local/global layers: KV blocks held per sequence and sequences
that fit at a fixed --kv-cache-blocks, with KV cache groups (a full and a sliding group, window blocks
released) against one block table for every layer (the runtime before groups), in one run.

Tiny random models from transformers' config classes with a window of 8: Gemma 2 (local, global
alternating) and Gemma 3 (5 local : 1 global). The same long prompts run in both engines, greedy
(the outputs must be equal). "held" is the KV memory a sequence holds, in blocks of every layer
(a group's block id holds num_slots of the num_layers layers); its peak is taken over the run.

Usage: python bench/sliding_window_blocks.py [--kv-cache-blocks 64] [--prompt-len 200] [--json]
"""

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tiny_families.py

from optkit.modeldir import resolve_model_dir  # noqa: E402
from optkit.runtime import engine as engine_module  # noqa: E402
from optkit.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from optkit.runtime.kv_groups import KVCacheGroups  # noqa: E402
from optkit.runtime.sequence import SamplingParams  # noqa: E402
from tests.tiny_families import FAMILIES, TINY  # noqa: E402

MODELS = {
    "gemma2 (1 local : 1 global)": dict(FAMILIES["gemma2"], sliding_window=8),
    "gemma3 (5 local : 1 global)": dict(
        FAMILIES["gemma3_text"],
        sliding_window=8,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    ),
}


def save_model(spec: dict, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    spec = {**TINY, **spec}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    draft = resolve_model_dir("draft")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(draft / file, out / file)
    return out


def run(path: Path, prompts: list[list[int]], blocks: int, max_tokens: int, grouped: bool) -> dict:
    """The engine as it is (grouped) or with every layer in one group, no window (the baseline)."""
    single = lambda windows: KVCacheGroups.single(len(windows))  # noqa: E731
    baseline = mock.patch.object(engine_module.KVCacheGroups, "for_windows", single)
    with contextlib.nullcontext() if grouped else baseline:
        engine = LLMEngine(path, EngineConfig(kv_cache_blocks=blocks, max_num_seqs=len(prompts)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"r{i}")
    groups, manager = engine.kv_groups, engine.block_manager
    outputs: dict[str, list[int]] = {}
    peak_running, peak_held = 0, 0.0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        running = engine.scheduler.running
        peak_running = max(peak_running, len(running))
        for seq in running:
            held = manager.num_held_blocks(seq) * groups.num_slots / groups.num_layers
            peak_held = max(peak_held, held)
    return {
        "groups": groups.num_groups,
        "block_ids": manager.num_blocks,
        "peak_held_per_seq": peak_held,
        "peak_running": peak_running,
        "preemptions": engine.scheduler.num_preemptions,
        "window_freed_blocks": manager.num_window_freed_blocks,
        "outputs": [outputs[f"r{i}"] for i in range(len(prompts))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-blocks", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY["vocab_size"], (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.num_prompts)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            path = save_model(spec, Path(tmp) / name.split()[0])
            before = run(path, prompts, args.kv_cache_blocks, args.max_tokens, grouped=False)
            after = run(path, prompts, args.kv_cache_blocks, args.max_tokens, grouped=True)
            assert before.pop("outputs") == after.pop("outputs"), f"{name}: the outputs differ"
            rows.append({"model": name, "before": before, "after": after})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"window 8, block 16, prompts of {args.prompt_len} + {args.max_tokens} tokens, "
          f"--kv-cache-blocks {args.kv_cache_blocks}; outputs equal before and after")  # fmt: skip
    print("| model | KV layout | block ids | peak held per sequence (blocks of every layer) | "
          "peak sequences running | preemptions |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in rows:
        for label, r in (("one table", row["before"]), (f"{row['after']['groups']} groups", row["after"])):
            print(f"| {row['model']} | {label} | {r['block_ids']} | {r['peak_held_per_seq']:.2f} | "
                  f"{r['peak_running']} | {r['preemptions']} |")  # fmt: skip
        b, a = row["before"], row["after"]
        print(f"| {row['model']} | ratio | | {a['peak_held_per_seq'] / b['peak_held_per_seq']:.2f}× | "
              f"{a['peak_running'] / b['peak_running']:.2f}× | |")  # fmt: skip


if __name__ == "__main__":
    main()
