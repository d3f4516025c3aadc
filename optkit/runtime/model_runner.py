"""Sequences in, logits out: packs a step's scheduled tokens into one flat batch, builds the
attention metadata over the paged KV cache, and runs the model.

Shapes for a step with B sequences and T new tokens in all (no padding):
  input_ids, positions, slot_mapping: [T];  logits: [R, vocab] for the S sequences that sample.
Each sampling sequence has one row of logits, its last token's, plus one per speculative proposal
it carries (`spec_token_ids`, run after its tokens): R = S + the number of proposals.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from optkit.errors import OptkitError
from optkit.kernels import kv_cache
from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models.llama import CausalLM, kv_cache_shape
from optkit.runtime.cuda_graphs import DecodeGraphs, graphs_unavailable_reason
from optkit.runtime.kv_groups import KVCacheGroups
from optkit.runtime.scheduler import ScheduledSequence
from optkit.runtime.sequence import Sequence


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    meta: AttentionMetadata  # the first KV cache group's
    group_metas: list[AttentionMetadata]  # per KV cache group: its block tables and slots
    sample_rows: torch.Tensor  # long [R]: each sampling sequence's last new token, then its proposals
    sampling_seqs: list[Sequence]


def pack(scheduled: list[ScheduledSequence], block_size: int, device: torch.device, num_groups: int = 1) -> PackedBatch:
    """Token t of a sequence is written to slot block_table[t // block_size] * block_size + t % block_size,
    in each KV cache group's table. Proposals take the positions after the sequence's end (the
    scheduler reserved their slots)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    query_lens: list[int] = []
    context_lens: list[int] = []
    sample_rows: list[int] = []
    sampling_seqs: list[Sequence] = []
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids += seq.token_ids[start:end]
        spec = item.spec_token_ids
        if spec:
            input_ids += spec
            end += len(spec)
        positions += range(start, end)
        for group_slots, table in zip(slots, seq.block_tables, strict=True):
            group_slots += [table[t // block_size] * block_size + t % block_size for t in range(start, end)]
        query_lens.append(end - start)
        context_lens.append(end)
        if item.samples:  # the step reaches the end of the sequence: its next token is sampled
            sample_rows.extend(range(len(input_ids) - 1 - len(spec), len(input_ids)))
            sampling_seqs.append(seq)
    metas = [
        AttentionMetadata.build(
            query_lens, context_lens, [item.seq.block_tables[g] for item in scheduled], slots[g], device
        )
        for g in range(num_groups)
    ]
    return PackedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=metas[0],
        group_metas=metas,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sampling_seqs=sampling_seqs,
    )


@dataclass
class DecodeSteps:
    """n decode steps of B sequences packed at once (multi-step decoding): step i runs each
    sequence's token at position num_computed_tokens + i, its slots reserved by the scheduler."""

    input_ids: torch.Tensor  # long [B]: each sequence's last token, step 0's input
    positions: torch.Tensor  # long [n, B]
    metas: list[list[AttentionMetadata]]  # [step][KV cache group]


def pack_decode_steps(
    scheduled: list[ScheduledSequence], num_steps: int, block_size: int, device: torch.device, num_groups: int = 1
) -> DecodeSteps:
    """`pack` for `num_steps` decode steps of sequences that each decode one token (step i's slot of
    position p: block_table[p // block_size] * block_size + p % block_size, as `pack`'s)."""
    seqs = [item.seq for item in scheduled]
    assert all(len(seq) - seq.num_computed_tokens == 1 for seq in seqs), "multi-step decoding runs decodes only"
    starts = [seq.num_computed_tokens for seq in seqs]
    num_seqs = len(seqs)
    positions = torch.tensor(starts, dtype=torch.long)[None, :] + torch.arange(num_steps)[:, None]  # [n, B]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    context_lens = (positions + 1).to(torch.int32)
    context_lists = context_lens.tolist()
    context_lens = context_lens.to(device)  # [n, B]: row i step i's, every group's
    metas: list[list[AttentionMetadata]] = [[] for _ in range(num_steps)]
    for g in range(num_groups):
        tables = [seq.block_tables[g] for seq in seqs]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)  # [B, nb]
        slots = block_tables.gather(1, (positions // block_size).T).T * block_size + positions % block_size
        block_tables = block_tables.to(torch.int32).to(device)
        slots = slots.contiguous().to(device)  # [n, B]: row i step i's
        for i in range(num_steps):
            metas[i].append(
                AttentionMetadata(
                    slot_mapping=slots[i],
                    query_start_loc=query_start_loc,
                    context_lens=context_lens[i],
                    block_tables=block_tables,
                    query_lens=[1] * num_seqs,
                    context_lens_list=context_lists[i],
                    max_query_len=1,
                    max_context_len=max(context_lists[i]),
                )
            )
    input_ids = torch.tensor([seq.token_ids[-1] for seq in seqs], dtype=torch.long, device=device)
    return DecodeSteps(input_ids, positions.to(device), metas)


class ModelRunner:
    """Owns the model and its KV cache: one (k, v) pair of [num_blocks, block_size, num_kv_heads,
    head_dim] tensors per layer, or per slot of the KV cache groups (runtime/kv_groups.py: layers of
    different groups share a slot's tensors, each through its own group's block table)."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
        groups: KVCacheGroups | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.groups = groups or KVCacheGroups.single(model.config.num_hidden_layers)
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        dtype = _activation_dtype(model)
        shape = kv_cache_shape(model.config, num_blocks, block_size)
        # plain tensors of the activation dtype, or 8-bit caches (kernels/kv_cache.py)
        slots = kv_cache.allocate(self.groups.num_slots, shape, kv_cache_dtype, dtype, self.device)
        self.kv_caches = [slots[slot] for slot in self.groups.layer_slots]
        self.kv_cache_dtype = kv_cache_dtype
        # an 8-bit cache's per-block scales included, spread over the block's tokens
        self.kv_bytes_per_token = kv_bytes_per_block(model, block_size, kv_cache_dtype) / block_size

    def capture_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, enforce_eager: bool, torch_compile: bool = False
    ) -> str:
        """Captures the decode steps' CUDA graphs (runtime/cuda_graphs.py) when they can run, each
        over a torch.compile'd forward with `torch_compile`; what was done, in words."""
        forward = None
        if torch_compile:
            if self.device.type != "cuda":
                raise OptkitError("--torch-compile needs --device cuda: on CPU the engine runs eagerly")
            forward = torch.compile(self.model, dynamic=False)
        reason = graphs_unavailable_reason(self.device, enforce_eager)
        if reason is None and self.groups.num_groups > 1:  # the captured decode has one block table
            reason = "several KV cache groups (sliding and full layers: each its own block table)"
        if reason is None and self.kv_cache_dtype != "auto":
            reason = f"--kv-cache-dtype {self.kv_cache_dtype} (the 8-bit cache runs the PyTorch attention path)"
        if reason is not None:
            self.graphs = None
            return f"CUDA graphs off: {reason}"
        graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, max_model_len, self.block_size, forward)
        graphs.capture()
        self.graphs = graphs
        buckets, seconds = graphs.buckets, graphs.capture_seconds
        return f"CUDA graphs: {len(buckets)} decode buckets up to {buckets[-1]}, captured in {seconds:.1f} s"

    def run(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one step; returns fp32 logits [R, vocab] and the S sequences they belong to (one row
        each, or 1 + len(spec_token_ids) consecutive rows for a sequence with proposals)."""
        logits, seqs, _ = self.run_with_hidden(scheduled)
        return logits, seqs

    @torch.inference_mode()
    def run_with_hidden(
        self, scheduled: list[ScheduledSequence], feature_layers: tuple[int, ...] = (-1,)
    ) -> tuple[torch.Tensor, list[Sequence], torch.Tensor]:
        """`run`, and the features [T, F] of every token the step ran, in pack order: each scheduled
        sequence's num_new_tokens rows, then one per proposal. `feature_layers` (-1,): the hidden
        states [T, hidden_size] after the final norm (the LM head's input: an EAGLE-1 head's feature),
        free, as the forward computes them anyway (a CUDA graph's are a view of its static output,
        valid until the next replay); else the residual streams entering those layers, concatenated
        [T, len·hidden_size] (an EAGLE-3 head's), from an eager forward."""
        aux_layers = () if tuple(feature_layers) == (-1,) else tuple(feature_layers)
        # CUDA graphs (runtime/cuda_graphs.py): a decode-only step replays a captured graph
        hidden = self.graphs.run(scheduled) if self.graphs is not None and not aux_layers else None
        if hidden is not None:
            return self.model.compute_logits(hidden), [item.seq for item in scheduled], hidden
        batch = pack(scheduled, self.block_size, self.device, self.groups.num_groups)
        meta = batch.meta if self.groups.num_groups == 1 else [batch.group_metas[g] for g in self.groups.layer_groups]
        hidden = features = self.model(batch.input_ids, batch.positions, meta, self.kv_caches, aux_layers)
        if aux_layers:
            hidden, features = hidden
        if not batch.sampling_seqs:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), [], features
        # sample_rows are distinct and increasing: as many as the rows means every row (a decode-only
        # step without proposals), taken without a gather
        rows = batch.sample_rows
        sampled = hidden if rows.shape[0] == hidden.shape[0] else hidden[rows]
        return self.model.compute_logits(sampled), batch.sampling_seqs, features

    @torch.inference_mode()
    def run_decode_steps(
        self,
        scheduled: list[ScheduledSequence],
        num_steps: int,
        choose: Callable[[torch.Tensor, int], torch.Tensor | None],
    ) -> None:
        """`num_steps` decode steps of the scheduled sequences, each of which decodes one token and
        holds the slots of the num_steps - 1 after it: choose(logits [B, vocab] float32, i) -> long
        [B], the tokens step i appends (step i + 1's input; None: the steps left are skipped), in
        `scheduled`'s order."""
        steps = pack_decode_steps(scheduled, num_steps, self.block_size, self.device, self.groups.num_groups)
        metas = [
            group_metas[0] if self.groups.num_groups == 1 else [group_metas[g] for g in self.groups.layer_groups]
            for group_metas in steps.metas
        ]
        self.model.decode_steps(steps.input_ids, steps.positions, metas, self.kv_caches, choose)


def kv_bytes_per_block(model: CausalLM, block_size: int, kv_cache_dtype: str = "auto", *, scales: bool = True) -> int:
    """K and V bytes of one block in every layer; an 8-bit cache's scale side table included unless
    `scales` is False (kernels/kv_cache.py)."""
    config = model.config
    return kv_cache.bytes_per_block(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, block_size, kv_cache_dtype,
        _activation_dtype(model), scales=scales,
    )  # fmt: skip


def _activation_dtype(model: CausalLM) -> torch.dtype:
    """The float dtype activations run in: that of the embedding."""
    return model.get_input_embeddings().weight.dtype
