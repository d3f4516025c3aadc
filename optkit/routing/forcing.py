"""Teacher forcing through the runtime's model, outside the engine: the logits a model gives at
every position of a finished sequence, computed chunk by chunk on a scratch KV cache of its own.

The engine's weights are shared (a forward pass only reads them), so a replay costs no memory but
its scratch cache ([ceil(T / block_size)] blocks per layer) and one chunk of logits at a time.
A chunk is a prefill step of the runtime's model (docs/runtime.md, "Packed batches") over tokens
[start, end) of one sequence whose block table is 0, 1, 2, ...: token t lives in slot t.
"""

import math
from collections.abc import Callable

import torch

from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models.llama import CausalLM, allocate_kv_caches
from optkit.routing.online import ShadowScore, score_rows, score_rows_topk

BLOCK_SIZE = 16


class ForcedPass:
    def __init__(self, model: CausalLM, num_tokens: int):
        self.model = model
        weight = model.get_input_embeddings().weight
        self.device = weight.device
        num_blocks = max(1, math.ceil(num_tokens / BLOCK_SIZE))
        self.block_table = list(range(num_blocks))
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, BLOCK_SIZE, weight.dtype, self.device)

    @torch.inference_mode()
    def logits(self, token_ids: list[int], start: int, end: int, first_row: int) -> torch.Tensor:
        """Runs tokens [start, end) (those before `start` already ran); fp32 logits [end - first_row, V]
        of positions first_row .. end-1 (first_row >= start)."""
        device = self.device
        meta = AttentionMetadata.build([end - start], [end], [self.block_table], list(range(start, end)), device)
        input_ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=device)
        positions = torch.arange(start, end, dtype=torch.long, device=device)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [end - start, hidden]
        return self.model.compute_logits(hidden[first_row - start :]).cpu()


def score_replay(
    full: CausalLM,
    quant: CausalLM,
    token_ids: list[int],
    num_prompt_tokens: int,
    chunk_tokens: int = 32,
    pause: Callable[[], None] = lambda: None,
) -> ShadowScore:
    """The online score of one request (routing/online.py): both models teacher-forced over
    prompt + output, compared at the positions that predict the output tokens. `pause()` runs
    before every forward step, so the caller can yield the CPU to client requests."""
    num_tokens = len(token_ids)
    first_scored = num_prompt_tokens - 1  # the last prompt position predicts the first output token
    last = num_tokens - 1  # the last token predicts nothing that was generated
    if first_scored >= last:
        return ShadowScore()
    passes = ForcedPass(full, last), ForcedPass(quant, last)
    targets = torch.tensor(token_ids, dtype=torch.long)
    score = ShadowScore()
    for start in range(0, last, chunk_tokens):
        end = min(start + chunk_tokens, last)
        first_row = max(start, first_scored)
        logits = []
        for forced in passes:
            pause()
            logits.append(forced.logits(token_ids, start, end, min(first_row, end)))
        if first_row < end:
            score = score + score_rows(logits[0], logits[1], targets[first_row + 1 : end + 1])
    return score


def forced_rows(model: CausalLM, token_ids: list[int], first_row: int, chunk_tokens: int, pause) -> torch.Tensor:
    """fp32 logits [len - 1 - first_row, V] of positions first_row .. len-2, teacher-forced in chunks."""
    last = len(token_ids) - 1
    forced, rows = ForcedPass(model, last), []
    for start in range(0, last, chunk_tokens):
        end = min(start + chunk_tokens, last)
        pause()
        rows.append(forced.logits(token_ids, start, end, min(max(start, first_row), end)))
    return torch.cat(rows)


def score_against_upstream(model: CausalLM, rows, job, upstream_is_full: bool, chunk_tokens: int, pause):
    """The score of a pair whose other model is an upstream (`rows`: its top k, upstream/prompt_logprobs.py)."""
    first = job.num_prompt_tokens - 1
    if first >= len(job.token_ids) - 1:
        return ShadowScore()
    logits = forced_rows(model, job.token_ids, first, chunk_tokens, pause)
    targets = torch.tensor(job.token_ids[first + 1 :], dtype=torch.long)
    return score_rows_topk(logits, rows.top_ids, rows.top_logp, rows.target_logp, targets, upstream_is_full)


def runtime_scorer(engines: dict, chunk_tokens: int, upstreams: dict | None = None):
    """The shadow worker's scorer over running `AsyncEngine`s: their models, teacher-forced; a pair
    with one of `upstreams` (name -> UpstreamEngine) scores against its top-k prompt log-probs."""
    models = {name: engine.engine.model for name, engine in engines.items()}
    upstreams = upstreams or {}

    def score(job, pause: Callable[[], None]) -> ShadowScore:
        if job.full in upstreams or job.quant in upstreams:
            from optkit.upstream.prompt_logprobs import upstream_rows

            upstream_is_full = job.full in upstreams
            local, remote = (job.quant, job.full) if upstream_is_full else (job.full, job.quant)
            first = job.num_prompt_tokens - 1
            rows = upstream_rows(upstreams[remote], job.token_ids, first) if first < len(job.token_ids) - 1 else None
            return score_against_upstream(models[local], rows, job, upstream_is_full, chunk_tokens, pause)
        return score_replay(
            models[job.full], models[job.quant], job.token_ids, job.num_prompt_tokens, chunk_tokens, pause
        )

    return score
