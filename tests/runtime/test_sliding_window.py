"""KV blocks that leave a sliding window are released early, on every layer (Mistral: one KV cache
group) or on the local layers only (Gemma 2 and 3: a sliding group beside a full one, each with its
own block tables from one pool), and the engine's output stays transformers' greedy output through
chunked prefill, preemption, prefix caching and speculative decoding."""

import shutil

import pytest
import torch

from optkit.runtime.block_manager import BlockManager
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.kv_groups import KVCacheGroups
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


def test_two_groups_release_window_blocks_in_the_sliding_group_only():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False, group_windows=(None, 6))
    seq = Sequence(list(range(20)))
    assert manager.allocate_slots(seq, 20) and manager.num_free_blocks == 16 - 2 * 5
    seq.num_computed_tokens = 20
    assert manager.free_out_of_window(seq) == 3  # the sliding group's blocks 0-2; the full group keeps all 5
    assert manager.num_free_blocks == 16 - 10 + 3 and len(set(seq.block_tables[0]) & set(seq.block_tables[1])) == 0
    manager.check_invariants()
    manager.free(seq)
    assert manager.num_free_blocks == 16
    manager.check_invariants()


def test_a_prefix_hit_takes_the_block_of_every_group():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, group_windows=(None, 2))
    seq = Sequence(list(range(16)))
    assert manager.allocate_slots(seq, 16)
    seq.num_computed_tokens = 16
    manager.cache_full_blocks(seq)
    assert manager.free_out_of_window(seq) == 3
    other = Sequence(list(range(16)) + [99])
    assert manager.allocate_cached_prefix(other) == 16
    assert other.block_tables == seq.block_tables  # the released sliding blocks came back from the cache
    manager.check_invariants()


@pytest.mark.parametrize(
    ("windows", "groups", "slots"),
    [
        ([None, None], [0, 0], [0, 1]),  # Llama: one group, a tensor per layer
        ([8, 8, 8], [0, 0, 0], [0, 1, 2]),  # Mistral
        ([8, None, 8, None], [0, 1, 0, 1], [0, 0, 1, 1]),  # Gemma 2: two groups of two share two tensors
    ],
)
def test_groups_split_the_layers_into_equal_groups_sharing_slots(windows, groups, slots):
    kv = KVCacheGroups.for_windows(windows)
    assert list(kv.layer_groups) == groups and list(kv.layer_slots) == slots
    assert all(windows[i] == kv.windows[g] for i, g in enumerate(kv.layer_groups))
    assert kv.num_block_ids(10) * kv.num_slots == 10 * len(windows)  # the same memory


def test_gemma3_pattern_has_one_full_group_and_five_sliding_groups():
    kv = KVCacheGroups.for_windows(([8] * 5 + [None]) * 2)  # 10 local layers, 2 global: groups of 2
    assert kv.num_slots == 2 and kv.windows == (8, 8, 8, 8, 8, None)
    # within a group every layer has its own tensor (groups share them)
    for g in range(kv.num_groups):
        members = [slot for slot, group in zip(kv.layer_slots, kv.layer_groups, strict=True) if group == g]
        assert sorted(members) == [0, 1]
    assert kv.num_block_ids(6) == 36  # 6 blocks of 12 layers = 36 ids of 2 layers


@pytest.mark.parametrize("group_windows", [None, (None, "w"), ("w", None, "w")])
def test_random_schedules_release_each_block_once_and_free_everything_at_the_end(group_windows):
    """Preemption, prefix hits (shared prompt starts), chunked prefill, windows from 1 token up, one
    sliding group or sliding groups beside a full one: the pool stays exactly the unreferenced blocks
    at every step, and every block is free at the end."""
    import random

    from optkit.runtime.scheduler import Scheduler, SchedulerConfig

    for trial in range(300 if group_windows is None else 150):
        rng = random.Random(trial)
        window = rng.randint(1, 9)
        windows = None if group_windows is None else tuple(window if w == "w" else None for w in group_windows)
        scale = 1 if windows is None else len(windows)
        manager = BlockManager(
            rng.randint(25, 40) * scale, rng.choice([2, 4]), rng.random() < 0.7, window, group_windows=windows
        )
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
            for seq in scheduler.running:  # the groups' tables cover the same tokens with distinct blocks
                assert len({len(t) for t in seq.block_tables}) == 1
        assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="module", params=["mistral", "gemma2", pytest.param("gemma3_text", marks=pytest.mark.slow)])
def windowed_dir(request, tmp_path_factory, draft_dir):
    """A tiny random model with a window of 8, on every layer (Mistral) or on every other layer
    (Gemma 2 and 3: sliding, full), with the reference tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_families import FAMILIES, TINY

    torch.manual_seed(0)
    spec = {**TINY, **FAMILIES[request.param], "sliding_window": 8}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key:
                param.add_(torch.randn_like(param) * 0.1)
    out = tmp_path_factory.mktemp(f"{request.param}-window")
    model.save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(draft_dir / file, out / file)
    return out


def test_the_engine_releases_window_blocks_and_keeps_transformers_output(windowed_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in (37, 9, 23, 50)]
    prompts.append(prompts[0][:32] + [5, 6, 7])  # shares 2 full blocks of 16 with the first
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(windowed_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None)[0, len(p) :].tolist()
            for p in prompts
        ]
    for config in (
        EngineConfig(block_size=4, max_num_batched_tokens=16),  # chunked prefill
        EngineConfig(block_size=4, kv_cache_blocks=18, max_num_batched_tokens=16),  # preemption
        EngineConfig(block_size=16),  # prefix caching
        EngineConfig(block_size=4, speculative="ngram", num_speculative_tokens=3),
    ):
        engine = LLMEngine(windowed_dir, config)
        manager = engine.block_manager
        assert manager.num_groups == (1 if "mistral" in windowed_dir.name else 2)  # Gemma: sliding, full
        assert engine.generate(prompts, params) == expected, config
        # again, after the first prompt's blocks were computed (and released from the window)
        assert engine.generate([prompts[4]], params) == [expected[4]], config
        assert manager.num_window_freed_blocks > 0, config
        assert manager.num_free_blocks == manager.num_blocks
        if config.kv_cache_blocks and manager.num_groups > 1:  # the full group's tables keep growing
            assert engine.scheduler.num_preemptions > 0
        if config.block_size == 16:  # a prefix hit in every group
            assert engine.scheduler.num_prefix_cache_hit_tokens >= 32
