"""KV blocks that leave a sliding window on every layer (Mistral) are released early, and the
engine's output stays transformers' greedy output through chunked prefill, preemption, prefix
caching and speculative decoding."""

import shutil

import pytest
import torch

from optkit.runtime.block_manager import BlockManager
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams, Sequence


def test_blocks_before_every_future_window_are_released_and_freed_once():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False, sliding_window=6)
    seq = Sequence(list(range(20)))
    assert manager.allocate_slots(seq, 20)
    seq.num_computed_tokens = 20  # the next token (position 20) sees positions 15..20: blocks 0-2 are behind
    assert manager.free_out_of_window(seq) == 3 and manager.num_free_blocks == 16 - 5 + 3
    assert manager.free_out_of_window(seq) == 0  # idempotent
    manager.check_invariants()
    manager.free(seq)
    assert manager.num_free_blocks == 16
    manager.check_invariants()


def test_with_prefix_caching_the_last_hashed_block_stays_held():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, sliding_window=2)
    seq = Sequence(list(range(16)))
    assert manager.allocate_slots(seq, 16)
    seq.num_computed_tokens = 16
    manager.cache_full_blocks(seq)
    assert manager.free_out_of_window(seq) == 3  # blocks 0-2; block 3 (the last hashed) stays
    assert manager.blocks[seq.block_table[3]].ref_count == 1
    # the released blocks stay in the prefix cache for the next request with the same prefix
    other = Sequence(list(range(16)) + [99])
    assert manager.allocate_cached_prefix(other) == 16
    manager.check_invariants()


def test_random_schedules_release_each_block_once_and_free_everything_at_the_end():
    """Preemption, prefix hits (shared prompt starts), chunked prefill, windows from 1 token up:
    the pool stays exactly the unreferenced blocks at every step, and every block is free at the end."""
    import random

    from optkit.runtime.scheduler import Scheduler, SchedulerConfig

    for trial in range(300):
        rng = random.Random(trial)
        manager = BlockManager(rng.randint(25, 40), rng.choice([2, 4]), rng.random() < 0.7, rng.randint(1, 9))
        budget = rng.choice([8, 16, 64])
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=200), manager
        )
        shared = [rng.randrange(50) for _ in range(40)]
        for _ in range(5):
            length = rng.randint(3, 40)
            prompt = shared[:length] if rng.random() < 0.5 else [rng.randrange(50) for _ in range(length)]
            scheduler.add(Sequence(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
        while scheduler.has_unfinished():
            output = scheduler.schedule()
            scheduler.update(output, {item.seq.seq_id: rng.randrange(50) for item in output.scheduled})
            manager.check_invariants()
        assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, draft_dir):
    """A tiny random Mistral with a window of 8 on every layer, with the reference tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_families import TINY

    torch.manual_seed(0)
    config = AutoConfig.for_model("mistral", **{**TINY, "sliding_window": 8})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key:
                param.add_(torch.randn_like(param) * 0.1)
    out = tmp_path_factory.mktemp("mistral-window")
    model.save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(draft_dir / file, out / file)
    return out


def test_the_engine_releases_window_blocks_and_keeps_transformers_output(mistral_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in (37, 9, 23, 50)]
    prompts.append(prompts[0][:32] + [5, 6, 7])  # shares 2 full blocks of 16 with the first: a prefix hit
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None)[0, len(p) :].tolist()
            for p in prompts
        ]
    for config in (
        EngineConfig(block_size=4, max_num_batched_tokens=16),  # chunked prefill
        EngineConfig(block_size=4, kv_cache_blocks=24),  # preemption
        EngineConfig(block_size=16),  # prefix caching
        EngineConfig(block_size=4, speculative="ngram", num_speculative_tokens=3),
    ):
        engine = LLMEngine(mistral_dir, config)
        assert engine.generate(prompts, params) == expected, config
        assert engine.block_manager.num_window_freed_blocks > 0, config
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
