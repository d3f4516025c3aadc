"""CUDA-graph bucketing and padding (pure functions; the capture itself needs a GPU)."""

import torch

from optkit.runtime.cuda_graphs import (
    PAD_CONTEXT_LEN,
    PAD_SLOT,
    decode_buckets,
    graph_decode_metadata,
    graphs_unavailable_reason,
    is_decode_step,
    pad_decode_inputs,
    pick_bucket,
)
from optkit.runtime.scheduler import ScheduledSequence
from optkit.runtime.sequence import SamplingParams, Sequence


def test_buckets_are_powers_of_two_then_steps_of_8_up_to_max():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_pick_bucket_is_the_smallest_that_fits_or_none():
    buckets = decode_buckets(32)
    assert [pick_bucket(n, buckets) for n in (1, 3, 8, 9, 17, 32)] == [1, 4, 8, 16, 24, 32]
    assert pick_bucket(33, buckets) is None


def test_padding_rows_write_nothing_and_see_one_key():
    inputs = pad_decode_inputs([7, 9], [5, 17], [[3], [4, 6]], block_size=16, bucket=4)
    assert inputs["input_ids"] == [7, 9, 0, 0]
    assert inputs["positions"] == [4, 16, 0, 0]
    assert inputs["slot_mapping"] == [3 * 16 + 4, 6 * 16 + 0, PAD_SLOT, PAD_SLOT]
    assert inputs["context_lens"] == [5, 17, PAD_CONTEXT_LEN, PAD_CONTEXT_LEN]
    assert inputs["block_tables"] == [[3, 0], [4, 6], [0, 0], [0, 0]]


def test_only_pure_decode_steps_use_graphs():
    params = SamplingParams(max_tokens=4)
    decoding = Sequence([1, 2, 3], params, "a")
    decoding.num_computed_tokens = 2
    prefill = Sequence([1, 2, 3], params, "b")
    assert is_decode_step([ScheduledSequence(decoding, 1)])
    assert not is_decode_step([ScheduledSequence(decoding, 1), ScheduledSequence(prefill, 3)])
    assert not is_decode_step([ScheduledSequence(decoding, 1, 2, [5, 6])])  # proposals
    assert not is_decode_step([])


def test_graph_metadata_fixes_the_host_values():
    meta = graph_decode_metadata(
        torch.full((4,), -1), torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
        torch.zeros(4, 8, dtype=torch.int32), max_model_len=128,
    )  # fmt: skip
    assert meta.query_lens == [1] * 4 and meta.max_query_len == 1 and meta.max_context_len == 128


def test_graphs_are_off_on_cpu_and_with_enforce_eager():
    assert "CUDA" in graphs_unavailable_reason(torch.device("cpu"), False)
    assert graphs_unavailable_reason(torch.device("cuda"), True) == "--enforce-eager"
