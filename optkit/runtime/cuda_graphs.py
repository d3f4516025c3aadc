"""CUDA graphs for decode steps, as nano-vllm does: one graph per batch-size bucket, captured
largest-first into one shared memory pool, over static input buffers.

A decode step (every scheduled sequence computes exactly its last token, no proposals) of B
sequences replays the graph of the smallest bucket >= B: the step's inputs are copied into the
first B rows of the static buffers, the other rows are padding. A pad row writes nothing (slot -1,
which the Triton `write_kv` skips) and attends to one key (context_len 1) of block 0: every
block is allocated and zero-initialised at start, so whatever block 0 holds is finite and the pad
row's output, never read, stays finite too. Prefill, mixed and speculative steps, and batches above
the largest bucket, run eagerly.

Graph safety: inside a graph nothing may sync with the host. The Triton decode kernels read every
length on the device (kernels/triton/paged_attention.py); the host values they use (number of
sequences, max_query_len 1, max_context_len for the number of context splits) are fixed per
bucket by `graph_decode_metadata` (max_context_len = max_model_len). The PyTorch attention path
builds index tensors from Python lists, so graphs are only used when the Triton kernels run.

Shapes, per bucket of size N: input_ids, positions, slot_mapping [N]; context_lens [N];
block_tables [N, max_blocks], max_blocks = ceil(max_model_len / block_size); hidden [N, hidden_size].
"""

import logging
import math
import time

import torch

from optkit.kernels.paged_attention import AttentionMetadata
from optkit.runtime.scheduler import ScheduledSequence

log = logging.getLogger(__name__)

PAD_SLOT = -1  # a slot the KV write skips
PAD_CONTEXT_LEN = 1  # a pad row attends to one key, block 0's first


# ------------------------------------------------------------------------ pure functions (tested on CPU)
def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 below max_num_seqs, then max_num_seqs itself."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 8)) + [max_num_seqs]


def pick_bucket(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding batch_size sequences; None above the largest (run eagerly)."""
    return next((b for b in sorted(buckets) if b >= batch_size), None)


def is_decode_step(scheduled: list[ScheduledSequence]) -> bool:
    """Every sequence computes its last token only, samples it, and carries no proposals."""
    return bool(scheduled) and all(
        item.num_new_tokens == 1
        and not item.spec_token_ids
        and item.samples
        and item.seq.num_computed_tokens + 1 == len(item.seq.token_ids)
        for item in scheduled
    )


def pad_decode_inputs(
    token_ids: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    bucket: int,
) -> dict[str, list]:
    """One decode step's inputs, padded to `bucket` rows. Sequence b's new token is its last, at
    position context_lens[b] - 1; its slot follows from its block table (docs/runtime.md)."""
    assert len(token_ids) == len(context_lens) == len(block_tables) <= bucket
    positions = [n - 1 for n in context_lens]
    pairs = zip(block_tables, positions, strict=True)
    slots = [table[p // block_size] * block_size + p % block_size for table, p in pairs]
    pad = bucket - len(token_ids)
    width = max((len(t) for t in block_tables), default=1)
    return {
        "input_ids": list(token_ids) + [0] * pad,
        "positions": positions + [0] * pad,
        "slot_mapping": slots + [PAD_SLOT] * pad,
        "context_lens": list(context_lens) + [PAD_CONTEXT_LEN] * pad,
        "block_tables": [list(t) + [0] * (width - len(t)) for t in block_tables] + [[0] * width] * pad,
    }


def graph_decode_metadata(
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_model_len: int,
) -> AttentionMetadata:
    """Metadata over static tensors for a decode step of N = len(context_lens) rows, whatever the
    contexts: the host-side fields are fixed (one query per row, contexts up to max_model_len), so
    a graph captured with it stays valid as contexts grow. Only for the Triton path: the PyTorch
    path would read `context_lens_list`, which here is an upper bound, not the truth."""
    num_rows = context_lens.shape[0]
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        context_lens=context_lens,
        block_tables=block_tables,
        query_lens=[1] * num_rows,
        context_lens_list=[max_model_len] * num_rows,
        max_query_len=1,
        max_context_len=max_model_len,
    )


# ------------------------------------------------------------------------------------ capture, replay
def graphs_unavailable_reason(device: torch.device, enforce_eager: bool) -> str | None:
    """Why decode steps run eagerly (None: they can use CUDA graphs)."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"device {device.type} (CUDA graphs need CUDA)"
    from optkit.kernels import triton as triton_kernels

    if not triton_kernels.use_triton(torch.empty(0, device=device)):
        return "the Triton kernels are off (OPTKIT_TRITON=0 or triton missing): the PyTorch attention path syncs"
    return None


class DecodeGraphs:
    """The captured graphs of one model runner's decode steps and their static buffers."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int, forward=None):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_model_len = max_model_len
        self.forward = forward or model  # a torch.compile'd forward (ModelRunner.capture_decode_graphs), or the model
        self.buckets = decode_buckets(max_num_seqs)
        device = next(model.parameters()).device
        rows, self.max_blocks = self.buckets[-1], math.ceil(max_model_len / block_size)
        long, int32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slot_mapping = torch.full((rows,), PAD_SLOT, **long)
        self.context_lens = torch.full((rows,), PAD_CONTEXT_LEN, **int32)
        self.block_tables = torch.zeros(rows, self.max_blocks, **int32)
        self.query_start_loc = torch.arange(rows + 1, **int32)  # one token per row
        dtype = model.get_input_embeddings().weight.dtype
        self.hidden = torch.zeros(rows, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0

    def _meta(self, bucket: int) -> AttentionMetadata:
        return graph_decode_metadata(
            self.slot_mapping[:bucket],
            self.query_start_loc[: bucket + 1],
            self.context_lens[:bucket],
            self.block_tables[:bucket],
            self.max_model_len,
        )

    def _step(self, bucket: int) -> None:
        hidden = self.forward(self.input_ids[:bucket], self.positions[:bucket], self._meta(bucket), self.kv_caches)
        self.hidden[:bucket] = hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so the smaller graphs fit in the pool it allocated."""
        start = time.perf_counter()
        pool = None
        for bucket in reversed(self.buckets):
            self._step(bucket)  # warm-up: Triton JIT, packed-weight caches, allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._step(bucket)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs in %.1f s", len(self.graphs), self.capture_seconds)

    def run(self, scheduled: list[ScheduledSequence]) -> torch.Tensor | None:
        """hidden [B, hidden_size] of a decode step by graph replay (a view of the static output:
        read it before the next replay); None when the step must run eagerly."""
        if not self.graphs or not is_decode_step(scheduled):
            return None
        bucket = pick_bucket(len(scheduled), self.buckets)
        if bucket is None:
            return None
        seqs = [item.seq for item in scheduled]
        inputs = pad_decode_inputs(
            [s.token_ids[-1] for s in seqs], [len(s.token_ids) for s in seqs],
            [s.block_table for s in seqs], self.block_size, bucket,
        )  # fmt: skip
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            buffer = getattr(self, name)
            buffer[:bucket].copy_(torch.tensor(inputs[name], dtype=buffer.dtype), non_blocking=True)
        tables = torch.tensor(inputs["block_tables"], dtype=torch.int32)  # [bucket, width]
        # columns past a row's context are never read (the kernel masks by context_len): stale is fine
        self.block_tables[:bucket, : tables.shape[1]].copy_(tables, non_blocking=True)
        self.graphs[bucket].replay()
        return self.hidden[: len(seqs)]
