"""Turning texts into fixed-length token windows, the same way for every model that is compared."""

import torch
from transformers import PreTrainedTokenizerBase


def tokenize_stream(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> torch.Tensor:
    """All texts tokenized and joined, each followed by EOS: a 1-D LongTensor."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def tokenize_stream_prefix(tokenizer: PreTrainedTokenizerBase, texts: list[str], num_tokens: int) -> torch.Tensor:
    """The first texts of `tokenize_stream(tokenizer, texts)` that hold at least `num_tokens` tokens
    (all of them if they hold fewer), tokenized 32 texts at a time: a large set is read only as far
    as it is used."""
    parts, total = [], 0
    for start in range(0, len(texts), 32):
        parts.append(tokenize_stream(tokenizer, texts[start : start + 32]))
        total += parts[-1].numel()
        if total >= num_tokens:
            break
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def pack_windows(tokens: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of `seq_len` tokens: [num_windows, seq_len]; the tail is dropped."""
    num_windows = tokens.numel() // seq_len
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    return tokens[: num_windows * seq_len].view(num_windows, seq_len)
