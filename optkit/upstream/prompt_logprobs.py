"""An upstream's teacher-forced log-probs over a finished sequence, for shadow scoring: vLLM's
`prompt_logprobs` (its top k at every position, plus the token that came next; k at most its
server's `--max-logprobs`, 20 by default). Synchronous: the shadow worker thread calls it."""

import json
import math
import urllib.request
from dataclasses import dataclass

import torch

from optkit.upstream.engine import UpstreamEngine, UpstreamError

UPSTREAM_TOP_K = 20  # vLLM's default --max-logprobs


@dataclass
class UpstreamRows:
    """Per scored position p (the distribution that predicts token p+1): the upstream's top k."""

    top_ids: torch.Tensor  # int64 [N, k], most likely first
    top_logp: torch.Tensor  # fp32 [N, k]
    target_logp: torch.Tensor  # fp32 [N]: log P(the token that came next)


def upstream_rows(engine: UpstreamEngine, token_ids: list[int], first_row: int, k: int = UPSTREAM_TOP_K):
    """Rows first_row .. len(token_ids)-2 of the upstream's distributions over `token_ids`."""
    body = {
        "model": engine.upstream_model,
        "prompt": token_ids,
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": k,
    }
    request = urllib.request.Request(
        f"{engine.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    if engine.api_key:
        request.add_header("Authorization", f"Bearer {engine.api_key}")
    where = f"upstream {engine.model_name} ({engine.url})"
    try:
        with urllib.request.urlopen(request, timeout=engine.limits.read_timeout_s) as response:
            entries = json.loads(response.read(64 << 20))["choices"][0]["prompt_logprobs"]
        return _rows(entries, token_ids, first_row, k)
    except (OSError, ValueError, LookupError, TypeError) as e:
        raise UpstreamError(502, f"{where} gave no prompt log-probs ({type(e).__name__})") from None


def _rows(entries: list, token_ids: list[int], first_row: int, k: int) -> UpstreamRows:
    """vLLM's entries[i] is {token id: {"logprob", "rank"}} for the distribution that predicts
    token i (entries[0] is None): row p is entries[p + 1]."""
    ids, logps, targets = [], [], []
    for p in range(first_row, len(token_ids) - 1):
        entry = {int(t): float(v["logprob"]) for t, v in entries[p + 1].items()}
        target = entry[token_ids[p + 1]]
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:k]
        ranked += [(0, -math.inf)] * (k - len(ranked))  # fewer than k tokens: empty columns
        ids.append([t for t, _ in ranked])
        logps.append([v for _, v in ranked])
        targets.append(target)
    return UpstreamRows(
        torch.tensor(ids, dtype=torch.long).view(-1, k),
        torch.tensor(logps, dtype=torch.float32).view(-1, k),
        torch.tensor(targets, dtype=torch.float32),
    )
