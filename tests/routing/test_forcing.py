"""Teacher forcing through the runtime's model, chunk by chunk, matches a plain forward pass."""

import pytest
import torch

from optkit.kernels import cpu_int4
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.load import load_model
from optkit.routing.forcing import score_replay
from optkit.routing.online import score_sequence

TOKENS = [17, 250, 3, 999, 42, 7, 7, 1200, 5, 88, 640, 12, 31, 2048, 9, 300, 77, 15, 400, 61, 2, 33]


@pytest.fixture(scope="module")
def models(draft_dir, draft_w2):
    return load_runtime_model(draft_dir), load_runtime_model(draft_w2)


@pytest.fixture(scope="module")
def offline(draft_dir, draft_w2):
    """As `optkit eval` scores: the HF modules, one forward pass over the whole sequence."""
    with torch.inference_mode():
        x = torch.tensor([TOKENS])
        return score_sequence(load_model(draft_dir)(x).logits[0], load_model(draft_w2)(x).logits[0], TOKENS, 8)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 64])
def test_replay_matches_the_offline_gate_on_the_same_tokens(models, offline, chunk_tokens):
    full, quant = models
    pauses = []
    with cpu_int4.reference_only():  # the same arithmetic as the offline modules: equal to rounding
        online = score_replay(full, quant, TOKENS, 8, chunk_tokens, pause=lambda: pauses.append(1))
    assert online.num_tokens == offline.num_tokens == len(TOKENS) - 8
    for key, value in offline.metrics().items():
        assert online.metrics()[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert len(pauses) == 2 * -(-(len(TOKENS) - 1) // chunk_tokens)  # before each step of each model


@pytest.mark.parametrize("chunk_tokens", [1, 64])
def test_replay_through_the_cpu_int4_kernel_stays_within_its_rounding_of_the_gate(models, offline, chunk_tokens):
    """The replay takes the CPU kernel (W4A8's int8 activations, or aten's bf16 ones) where the offline
    gate takes the dequantize reference: the online numbers move by the kernel's rounding, not more."""
    online = score_replay(*models, TOKENS, 8, chunk_tokens)
    for key, value in offline.metrics().items():
        # percentages (a perplexity change, a top-1 rate) within one point: over these 14 tokens a mean
        # log-prob moved by 0.01 nats (W4A8 on this 2-bit model: 0.007) moves the perplexity by 1%;
        # the rest within 1%
        tolerance = dict(abs=1.0) if key.endswith("pct") else dict(rel=1e-2, abs=1e-3)
        assert online.metrics()[key] == pytest.approx(value, **tolerance), key


def test_a_request_without_output_scores_nothing(models):
    assert score_replay(*models, TOKENS[:5], 5).num_tokens == 0
