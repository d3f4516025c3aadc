"""Proposals from an EAGLE head (Li et al. 2024; EAGLE-3, Li et al. 2025), inside continuous
batching: a chain of k tokens per sequence from one decoder layer over the target's own features
(runtime/eagle_layer.py for EAGLE-1, runtime/eagle3_layer.py for EAGLE-3, by the head's "kind").

The head's row at position t reads (feature f_t, token x_{t+1}) and predicts f_{t+1}, whose logits
through the target's LM head give x_{t+2}. For a sequence of L tokens whose real features f_0..f_{L-2}
the target has computed (it has not run x_{L-1} yet), one step is k passes:
  pass 1: rows t = V..L-2 with the real features, V = the positions the head's KV already holds;
          the last row's prediction f'_{L-1} gives d_1;
  pass j: one row at t = L+j-3 with (f'_{t}, d_{j-1}): f'_{t+1} gives d_j.
EAGLE-3 reads, for real rows, the target's residual streams at three layers (fused by its fc), and
for drafted rows its own pre-norm output one row back (vLLM's Eagle3); the rest is the same.
Only pass 1's KV is stable (EAGLE's stable_kv, vLLM's EagleProposer): the head counts positions
< L-1 as computed, so rows of passes 2..k, drafted from predicted features, lie past its
num_computed_tokens and are overwritten next step by the same positions recomputed from the
target's real features (the verification's rows x_{L-1}, d_1..d_a, handed over by `observe`).

The head's KV cache mirrors the target's: a BlockManager (prefix caching included) over a shadow
Sequence per target sequence. The shadow's token at position t is the pair (x_t, x_{t+1}) as one
id, x_t·V + x_{t+1}: the head's KV at t depends on x_0..x_{t+1}, so its block hashes chain exactly
what the KV was computed from. A head prefix hit shorter than the target's (the target computed
no features for its cached tokens) is filled by running the target over the missing prefix
(`num_recomputed_tokens` counts them). A preempted or finished sequence frees its head blocks;
when the head's cache is full, the sequence gets no proposals that step.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models.llama import CausalLM, allocate_kv_caches
from optkit.runtime.block_manager import BlockManager
from optkit.runtime.eagle3_layer import Eagle3Layer, eagle3_layer_shapes
from optkit.runtime.eagle_layer import EagleLayer, layer_shapes
from optkit.runtime.proposers import DraftGenerators, Proposal, sample_proposals
from optkit.runtime.sampler import is_greedy
from optkit.runtime.sequence import Sequence, SequenceStatus
from optkit.runtime.speculative import ProposalContext
from optkit.speculative.eagle_head import KIND3, EagleHead, load_head


def pair_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    """x_0..x_{L-1} -> the head's shadow tokens x_t·V + x_{t+1} for t = 0..L-2."""
    return [a * vocab_size + b for a, b in zip(token_ids[:-1], token_ids[1:], strict=True)]


@dataclass
class _HeadState:
    seq: Sequence
    shadow: Sequence  # the head's block table; num_computed_tokens: positions with KV from real features


@dataclass
class _Row:
    """One sequence's rows in a pass: tokens and features at positions start..start+n-1."""

    state: _HeadState
    k: int
    token_ids: list[int]
    features: torch.Tensor  # [n, F]: the target's features (real), or the head's own [n, H]
    start: int
    real: bool = True


class EagleProposer:
    name = "eagle"

    def __init__(self, target: CausalLM, head: EagleHead, num_blocks: int, block_size: int, prefix_caching: bool):
        embedding = target.get_input_embeddings().weight
        self.target, self.block_size = target, block_size
        self.device, self.dtype = embedding.device, embedding.dtype
        # EAGLE-1: (-1,), the LM head's input; EAGLE-3: the three layers whose input it reads
        self.feature_layers = tuple(head.config.feature_layers)
        layer_class = Eagle3Layer if head.config.kind == KIND3 else EagleLayer
        self.layer = layer_class(target, head, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.kv_cache = allocate_kv_caches(self.layer.config, num_blocks, block_size, self.dtype, self.device)[0]
        self._states: dict[int, _HeadState] = {}  # target seq_id -> state
        self._features: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first position, [n, H]) unread
        self._generators = DraftGenerators(self.device)
        self.num_recomputed_tokens = 0  # target positions run again for features a prefix hit skipped

    @classmethod
    def load(
        cls, head_dir: Path, target: CausalLM, target_dir: Path, num_blocks: int, block_size: int, prefix_caching: bool
    ) -> "EagleProposer":
        def shapes(config):
            return (eagle3_layer_shapes if config.kind == KIND3 else layer_shapes)(target.config, config)

        head = load_head(head_dir, target_dir, shapes)
        return cls(target, head, num_blocks, block_size, prefix_caching)

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        if not len(hidden) or seq.is_finished:  # finished (aborted) while the step ran: released already
            return
        hidden = hidden.detach().clone()  # a CUDA graph's output buffer is overwritten by the next replay
        unread = self._features.get(seq.seq_id)
        if unread is not None and unread[0] <= start <= unread[0] + len(unread[1]):
            hidden, start = torch.cat((unread[1][: start - unread[0]], hidden)), unread[0]
        self._features[seq.seq_id] = (start, hidden)

    @torch.inference_mode()
    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        for state in list(self._states.values()):  # a safety net: `release` should have been called
            if state.seq.status is not SequenceStatus.RUNNING:
                self.release(state.seq)
        rows: list[_Row | None] = []
        for seq, k in items:
            state = self._sync(seq)
            computed, end = state.shadow.num_computed_tokens, len(seq) - 1
            if k < 1 or not self.block_manager.allocate_slots(state.shadow, end - computed, k - 1):
                self.release(seq)
                rows.append(None)
                continue
            features = self._real_features(seq, computed, end)
            rows.append(_Row(state, k, seq.token_ids[computed + 1 :], features, computed))
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        for j in range(max((row.k for row in rows if row is not None), default=0)):
            batch = [(i, row) for i, row in enumerate(rows) if row is not None and row.k > j]
            tokens, q, predicted = self._pass([row for _, row in batch], [drafts[i] for i, _ in batch])
            for b, (i, row) in enumerate(batch):
                drafts[i].append(tokens[b])
                if q is not None and not is_greedy(row.state.seq.params):
                    probs[i].append(q[b])
                if j == 0:  # pass 1 ran real features only: that KV stands
                    row.state.shadow.num_computed_tokens = len(row.state.seq) - 1
                    self.block_manager.cache_full_blocks(row.state.shadow)
                position = row.start + len(row.token_ids)  # the next row: (f'_position, d_{j+1})
                rows[i] = _Row(row.state, row.k, [tokens[b]], predicted[b : b + 1], position, real=False)
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs, strict=True)]

    def _pass(self, rows: list[_Row], drafts: list[list[int]]) -> tuple[list[int], torch.Tensor | None, torch.Tensor]:
        """One head forward over every row; per sequence its next proposal (q: its distribution) and
        the last row's predicted feature [B, H]."""
        bs, device = self.block_size, self.device
        spans = [range(row.start, row.start + len(row.token_ids)) for row in rows]
        tables = [row.state.shadow.block_table for row in rows]
        slots = [table[t // bs] * bs + t % bs for span, table in zip(spans, tables, strict=True) for t in span]
        meta = AttentionMetadata.build([len(s) for s in spans], [s.stop for s in spans], tables, slots, device)
        token_ids = torch.tensor([t for row in rows for t in row.token_ids], dtype=torch.long, device=device)
        positions = torch.tensor([t for span in spans for t in span], dtype=torch.long, device=device)
        features = torch.cat([row.features for row in rows])
        real = rows[0].real  # a pass is all real rows (the first) or all drafted ones
        out = self.layer(self.target, token_ids, features, positions, meta, self.kv_cache, real)  # [T, H]
        last = torch.tensor([sum(len(s) for s in spans[: b + 1]) - 1 for b in range(len(rows))], device=device)
        predicted = out[last]  # [B, H]
        seqs = [row.state.seq for row in rows]
        contexts = [ProposalContext(seq, d) for seq, d in zip(seqs, drafts, strict=True)]
        tokens, q = sample_proposals(self.layer.logits(self.target, predicted), contexts, seqs, self._generators)
        return tokens, q, predicted

    def _sync(self, seq: Sequence) -> _HeadState:
        """The sequence's head state: the shadow's tokens up to date, its speculative KV given back."""
        codes = pair_ids(seq.token_ids, self.target.config.vocab_size)
        state = self._states.get(seq.seq_id)
        if state is None:
            shadow = Sequence(codes, seq.params, f"eagle-{seq.request_id}")
            self.block_manager.allocate_cached_prefix(shadow)
            state = self._states[seq.seq_id] = _HeadState(seq, shadow)
            return state
        state.shadow.token_ids = codes  # computed positions keep their pairs: those tokens are final
        self.block_manager.free_surplus(state.shadow)
        return state

    def _real_features(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """The target's features of positions start..end-1 [end - start, H]: those `observe` handed
        over, or, where a prefix-cache hit left some out, the target run again over the prefix."""
        first, unread = self._features.pop(seq.seq_id, (None, None))
        if unread is None or first > start or first + len(unread) < end:
            first, unread = 0, self._target_features(seq.token_ids[:end])
        return unread[start - first : end - first]

    def _target_features(self, token_ids: list[int]) -> torch.Tensor:
        """The target's features [n, F] of `token_ids` (those the head reads), as one prefill over a
        scratch KV cache."""
        n, bs = len(token_ids), self.block_size
        num_blocks = -(-n // bs)
        caches = allocate_kv_caches(self.target.config, num_blocks, bs, self.dtype, self.device)
        meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], list(range(n)), self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        self.num_recomputed_tokens += n
        if self.feature_layers == (-1,):
            return self.target(ids, torch.arange(n, device=self.device), meta, caches)
        return self.target(ids, torch.arange(n, device=self.device), meta, caches, self.feature_layers)[1]

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(seq.seq_id, None)
        if state is not None:
            self.block_manager.free(state.shadow)
        self._features.pop(seq.seq_id, None)
        if seq.is_finished:
            self._generators.forget(seq)
