"""Drive a `CausalLM` step by step over a freshly allocated paged KV cache, as the runtime does."""

import math
import random
from pathlib import Path

import torch

from optkit.kernels.paged_attention import AttentionMetadata
from optkit.models.llama import CausalLM, allocate_kv_caches

Step = list[tuple[int, int]]  # (sequence, number of new tokens)


def prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Token ids of Python source (what the bundled models were trained on), one prompt per length."""
    ids = tokenizer(Path(random.__file__).read_text())["input_ids"]
    out, start = [], 0
    for n in lengths:
        out.append(ids[start : start + n])
        start += n
    assert all(len(p) == n for p, n in zip(out, lengths, strict=True))
    return out


def whole_prefills(lengths: list[int]) -> list[Step]:
    """One step: every sequence prefilled at once."""
    return [[(i, n) for i, n in enumerate(lengths)]]


def chunked_then_decode(lengths: list[int], seed: int = 0, max_chunk: int = 40) -> list[Step]:
    """Prefill the first half of each sequence in random chunks, then one token per step; sequences
    join and pause at random, so steps mix prefill chunks and decodes."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        step = []
        for i, n in enumerate(lengths):
            if done[i] == n or (len(steps) > 0 and rng.random() < 0.2):
                continue
            size = rng.randint(2, max_chunk) if done[i] < n // 2 else 1
            step.append((i, min(size, n - done[i])))
            done[i] += step[-1][1]
        if step:
            steps.append(step)
    return steps


@torch.inference_mode()
def run_paged(
    model: CausalLM, sequences: list[list[int]], steps: list[Step], block_size: int = 16, seed: int = 0
) -> list[torch.Tensor]:
    """fp32 logits [len, vocab] of every position of every sequence, computed through `steps`."""
    blocks_needed = [math.ceil(len(s) / block_size) for s in sequences]
    pool = torch.randperm(sum(blocks_needed) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in blocks_needed:
        tables.append(pool[:n])
        pool = pool[n:]
    dtype = model.get_input_embeddings().weight.dtype
    caches = allocate_kv_caches(model.config, sum(blocks_needed) + 3, block_size, dtype)
    logits = [torch.empty(len(s), model.config.vocab_size) for s in sequences]
    done = [0] * len(sequences)
    for step in steps:
        ids, positions, slots, query_lens, context_lens, owners = [], [], [], [], [], []
        for i, n in step:
            start, end = done[i], done[i] + n
            ids += sequences[i][start:end]
            positions += range(start, end)
            slots += [tables[i][t // block_size] * block_size + t % block_size for t in range(start, end)]
            query_lens.append(n)
            context_lens.append(end)
            owners += [(i, t) for t in range(start, end)]
            done[i] = end
        meta = AttentionMetadata.build(query_lens, context_lens, [tables[i] for i, _ in step], slots, "cpu")
        hidden = model(torch.tensor(ids), torch.tensor(positions), meta, caches)
        for row, (i, t) in zip(model.compute_logits(hidden), owners, strict=True):
            logits[i][t] = row
    return logits


@torch.inference_mode()
def greedy_generate(
    model: CausalLM, sequences: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> list[list[int]]:
    """Greedy continuations: one step prefills every prompt, then each step decodes all of them."""
    tables, next_block = [], 0
    for s in sequences:
        n = math.ceil((len(s) + max_new_tokens) / block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])  # blocks out of order on purpose
        next_block += n
    dtype = model.get_input_embeddings().weight.dtype
    caches = allocate_kv_caches(model.config, next_block, block_size, dtype)
    tokens = [list(s) for s in sequences]
    new = [len(s) for s in sequences]  # tokens of each sequence not yet in the cache
    for _ in range(max_new_tokens):
        ids, positions, slots, context_lens = [], [], [], []
        for seq, table, n in zip(tokens, tables, new, strict=True):
            ids += seq[len(seq) - n :]
            positions += range(len(seq) - n, len(seq))
            slots += [table[t // block_size] * block_size + t % block_size for t in range(len(seq) - n, len(seq))]
            context_lens.append(len(seq))
        meta = AttentionMetadata.build(new, context_lens, tables, slots, "cpu")
        hidden = model(torch.tensor(ids), torch.tensor(positions), meta, caches)
        last_rows = meta.query_start_loc[1:].long() - 1
        for seq, token in zip(tokens, model.compute_logits(hidden[last_rows]).argmax(-1).tolist(), strict=True):
            seq.append(token)
        new = [1] * len(tokens)
    return [seq[len(s) :] for seq, s in zip(tokens, sequences, strict=True)]
