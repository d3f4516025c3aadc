"""Offline measure of an EAGLE head: the mean acceptance length (accepted tokens + 1 per target
step) of greedy chain speculation, simulated with the target's transformers model.

The target continues each prompt greedily; then, step after step as the engine would, the head
extends the last accepted token from the target's real features of the context (the head's cache
recomputed from real features after each verification, EAGLE's stable_kv) and drafts k tokens by
feeding its own predicted features back; the step accepts the drafts that match the target's
continuation, plus the target's own token.
"""

import torch
from torch import nn

from optkit.data.packing import pack_windows, tokenize_stream
from optkit.speculative.distill3 import residual_streams
from optkit.speculative.eagle3_model import Eagle3HeadModel
from optkit.speculative.head_model import EagleHeadModel, first_layer_embedding


def eval_prompts(tokenizer, texts: list[str], num_prompts: int, prompt_len: int) -> torch.Tensor:
    """[num_prompts, prompt_len]: windows spread evenly over the texts' token stream."""
    windows = pack_windows(tokenize_stream(tokenizer, texts), prompt_len)
    if len(windows) == 0:
        return windows
    picks = torch.linspace(0, len(windows) - 1, min(num_prompts, len(windows))).round().long()
    return windows[picks]


@torch.no_grad()
def greedy_continuations(target: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[N, P + new_tokens]: each prompt followed by the target's argmax tokens (EOS not special)."""
    out = target(prompts, use_cache=True)
    tokens = [prompts, out.logits[:, -1:].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = target(tokens[-1], cache=out.cache, use_cache=True)
        tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def draft_chain(head, embed, lm_head, embeds, features, k):
    """The head's k greedy drafts after a context of real inputs: embeds, features [1, S, H]."""
    drafts = []
    for _ in range(k):
        positions = torch.arange(embeds.shape[1])[None]
        predicted = head(embeds, features, positions)[:, -1:]  # [1, 1, H]: the next feature
        token = lm_head(predicted).argmax(-1)  # [1, 1]
        drafts.append(token.item())
        embeds = torch.cat((embeds, embed(token)), dim=1)
        features = torch.cat((features, predicted), dim=1)
    return drafts


def draft_chain3(head: Eagle3HeadModel, embed, embeds, residuals, k):
    """An EAGLE-3 head's k greedy drafts after a context of real rows: embeds, residuals (fc of the
    target's fused features) [1, S, H]; each drafted row feeds back the head's own h."""
    drafts = []
    for _ in range(k):
        hidden = head(embeds, residuals, torch.arange(embeds.shape[1]))[:, -1:]  # [1, 1, H]
        token = head.draft_ids[head.logits(hidden).argmax(-1)]  # [1, 1]: the target's id
        drafts.append(token.item())
        embeds = torch.cat((embeds, embed(token)), dim=1)
        residuals = torch.cat((residuals, hidden), dim=1)
    return drafts


@torch.no_grad()
def acceptance_lengths(
    head: EagleHeadModel | Eagle3HeadModel, target: nn.Module, sequences: torch.Tensor, prompt_len: int, k: int
) -> list[int]:
    """Accepted tokens + 1 of every simulated step over the greedy `sequences` [N, T] (a step whose k
    drafts would reach past the end is not taken)."""
    embed, lm_head = first_layer_embedding(target), target.get_output_embeddings()
    embeds = embed(sequences).float()
    if isinstance(head, Eagle3HeadModel):
        residuals = head.fc(residual_streams(target, sequences, head.feature_layers)[0])

        def chain(n: int, s: int) -> list[int]:
            return draft_chain3(head, embed, embeds[n : n + 1, 1 : s + 1], residuals[n : n + 1, :s], k)
    else:
        features = target.get_decoder()(sequences).last_hidden_state.float()

        def chain(n: int, s: int) -> list[int]:
            return draft_chain(head, embed, lm_head, embeds[n : n + 1, 1 : s + 1], features[n : n + 1, :s], k)

    lengths = []
    for n in range(sequences.shape[0]):
        s = prompt_len  # the target's first token, from its prefill
        while s + k < sequences.shape[1]:
            drafts = chain(n, s)
            accepted = 0
            while accepted < k and drafts[accepted] == sequences[n, s + 1 + accepted].item():
                accepted += 1
            lengths.append(accepted + 1)
            s += accepted + 1
    return lengths


def mean_acceptance_length(
    head: EagleHeadModel | Eagle3HeadModel, target: nn.Module, prompts: torch.Tensor, k: int, new_tokens: int = 64
) -> float:
    """The head's mean acceptance length at `k` on the target's greedy continuations of `prompts`."""
    head.eval()
    sequences = greedy_continuations(target, prompts, new_tokens)
    lengths = acceptance_lengths(head, target, sequences, prompts.shape[1], k)
    return sum(lengths) / len(lengths) if lengths else 1.0
