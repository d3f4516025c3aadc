"""KLD of an artifact against its base on held-out windows, and a paired "no worse than" check.

Two W8A8 artifacts of a tiny model can differ by less than the evaluation's sampling noise: on the
tiny Gemma 2, SmoothQuant and plain W8A8 measure 1.04x apart on 8 windows of 64 tokens and 1.004x on
48 (a paired difference of 0.3 standard errors). So "no worse" is asserted as a one-sided paired test:
the mean per-window KLD difference is at most two standard errors of itself above zero (a real
regression of that size or more fails; tokens within one window are not independent).

The windows are spread evenly over the whole held-out set, not taken one after another from its
start: windows of the same passage are alike, so consecutive ones sample a few texts and their
standard error understates how much the mean moves from text to text. On the tiny Phi-3 the first 48
consecutive windows (4 of the 16 texts) read SmoothQuant auto 2.4 SE worse than plain W8A8; the
other 14 blocks of 48 read 4.4 SE better to 0.9 SE worse, the whole set (751 windows) 0.981x.
"""

import torch

from optkit.gate.metrics import full_kld
from tests.models.paged import run_paged, whole_prefills

WINDOW, NUM_WINDOWS = 64, 48


def heldout_windows(path, num_windows: int = NUM_WINDOWS) -> list[list[int]]:
    """`num_windows` disjoint windows of WINDOW tokens, one every len(stream) / num_windows tokens of
    the held-out set: each text contributes in proportion to its length."""
    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import tokenize_stream
    from optkit.modeldir import load_tokenizer

    stream = tokenize_stream(load_tokenizer(path), load_text_set("heldout").texts)
    stride = len(stream) // num_windows
    assert stride >= WINDOW, "the held-out set is shorter than the windows asked for"
    return [stream[i * stride : i * stride + WINDOW].tolist() for i in range(num_windows)]


def window_klds(base, artifact, windows: list[list[int]]) -> torch.Tensor:
    """Mean KLD(base || artifact) per window, through optkit's runtime: [num_windows]."""
    from optkit.models.loader import load_runtime_model

    def logits(path):
        model = load_runtime_model(path)
        return torch.cat(run_paged(model, windows, whole_prefills([len(w) for w in windows]), block_size=16))

    return full_kld(logits(base), logits(artifact)).reshape(len(windows), -1).mean(dim=1)


def assert_no_worse(candidate: torch.Tensor, baseline: torch.Tensor) -> None:
    """candidate's per-window KLDs are no worse than baseline's, within two paired standard errors."""
    diff = candidate - baseline
    standard_error = diff.std() / len(diff) ** 0.5
    assert diff.mean() <= 2 * standard_error, (
        f"mean KLD {candidate.mean():.4e} vs {baseline.mean():.4e}: worse by {diff.mean():.3e}, "
        f"over 2 standard errors ({2 * standard_error:.3e})"
    )
