"""The pure parts of routing: tier rules, queue waits, prefix affinity, KV budgets."""

import pytest

from optkit.errors import OptkitError
from optkit.routing.config import ServeOptions, TiersOptions
from optkit.routing.load import LoadTracker, PrefixTable
from optkit.routing.startup import kv_cache_blocks
from optkit.routing.tiers import TierPolicy
from optkit.runtime.engine import EngineConfig


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tier_rules_escalate_to_the_biggest_match():
    tiers = TiersOptions(
        order=["s", "m", "l"],
        default="s",
        rules=[
            {"name": "long", "min_prompt_tokens": 100},
            {"regex": r"(?i)\bprove\b", "to": "l"},
            {"name": "long-code", "min_prompt_tokens": 50, "regex": "def "},
        ],
    )
    policy = TierPolicy(tiers, ["s", "m", "l"])
    assert policy.escalate("s", 10, "hello") == ("s", None)
    assert policy.escalate("s", 100, "hello") == ("m", "long")
    assert policy.escalate("m", 100, "hello") == ("l", "long")  # the next after the start
    assert policy.escalate("s", 10, "Prove it") == ("l", "regex")
    assert policy.escalate("s", 60, "def f():") == ("m", "long-code")
    assert policy.escalate("s", 40, "def f():") == ("s", None)  # every condition of a rule must hold
    assert policy.escalate("l", 100, "prove") == ("l", None)  # never down, never past the top


def test_queue_wait_is_the_oldest_pending_or_the_last_seen():
    clock = Clock()
    load = LoadTracker(["a", "b"], window_s=5.0, clock=clock)
    first = load.start("a")
    clock.now += 2.0
    assert load.queue_wait("a") == 2.0 and load.queue_wait("b") == 0.0 and load.idle_for() == 0.0
    load.first_output(first)
    clock.now += 1.0
    assert load.queue_wait("a") == 2.0  # the last wait observed, for window_s
    clock.now += 5.0
    assert load.queue_wait("a") == 0.0
    load.finish(first)
    clock.now += 0.5
    assert load.running == {"a": 0, "b": 0} and load.idle_for() == 0.5


def test_prefix_table_finds_the_longest_cached_prefix():
    table = PrefixTable(block_size=4, capacity=100)
    shared = list(range(12))
    table.record(table.block_hashes(shared + [50, 51, 52, 53]), "a")
    table.record(table.block_hashes(shared[:4] + [9, 9, 9, 9]), "b")
    assert table.lookup(table.block_hashes(shared + [60, 61, 62, 63, 64]), ["a", "b"]) == ("a", 12)
    assert table.lookup(table.block_hashes(shared[:4] + [9, 9, 9, 9, 1]), ["a", "b"]) == ("b", 8)
    assert table.lookup(table.block_hashes(shared), ["b"]) == ("b", 4)  # a holds more, but is not a candidate
    assert table.lookup(table.block_hashes([7] * 8), ["a", "b"]) == (None, 0)
    small = PrefixTable(block_size=4, capacity=2)
    small.record(small.block_hashes(shared), "a")
    assert len(small.owner) == 2 and small.lookup(small.block_hashes(shared), ["a"]) == ("a", 12)


def test_kv_budget_per_model():
    gib = 2**30
    base = EngineConfig(max_num_seqs=64, max_model_len=256)
    # draft: 2 layers x 2 kv heads x 32 head_dim x 2 (k, v) x 16 tokens x 4 bytes = 16 KiB a block;
    # wanted: 64 sequences x 16 blocks = 1024 blocks
    opts = ServeOptions(models={"a": {"path": "draft", "kv_cache_fraction": 0.25}, "b": {"path": "draft"}})
    assert kv_cache_blocks(opts, base, memory_bytes=4 * 2**20 * 16) == {"a": 256, "b": 768}  # 16 MiB budget
    assert kv_cache_blocks(opts, base, memory_bytes=64 * gib) == {"a": 1024, "b": 1024}  # capped at wanted
    opts = ServeOptions(models={"a": {"path": "draft", "kv_cache_blocks": 7}, "b": {"path": "draft"}})
    assert kv_cache_blocks(opts, base, memory_bytes=4 * 2**20 * 16)["a"] == 7
    alone = ServeOptions(models={"a": {"path": "draft"}})
    assert kv_cache_blocks(alone, base, memory_bytes=gib) == {"a": None}  # the engine's own default


def test_kv_fractions_that_take_everything_leave_nothing_for_the_rest():
    opts = ServeOptions(models={"a": {"path": "draft", "kv_cache_fraction": 1.0}, "b": {"path": "draft"}})
    with pytest.raises(OptkitError, match="no KV memory is left for b"):
        kv_cache_blocks(opts, EngineConfig(), memory_bytes=2**30)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_kv_fraction_bounds_the_cache_the_engine_builds(kv_cache_dtype):
    """The share is what the built cache takes, an 8-bit cache's scale side table included."""
    from optkit.runtime.engine import KV_CACHE_MEMORY_FRACTION, LLMEngine

    memory = 64 * 2**20
    base = EngineConfig(max_num_seqs=64, max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    opts = ServeOptions(models={"a": {"path": "draft", "kv_cache_fraction": 0.25}, "b": {"path": "draft"}})
    blocks = kv_cache_blocks(opts, base, memory_bytes=memory)
    engine = LLMEngine("draft", base.model_copy(update={"kv_cache_blocks": blocks["a"]}))
    used = {id(t): t.nbytes for k, v in engine.runner.kv_caches for t in (k, v)}  # layers may share a slot
    share = 0.25 * memory * KV_CACHE_MEMORY_FRACTION
    assert 0.97 * share <= sum(used.values()) <= share
