"""Per-layer sensitivity (gate/attribution.py) and the held-out windows it runs on (data/holdout.py)."""

import pytest
import torch

from optkit.data.holdout import sampled_starts, uncovered_windows
from optkit.gate.attribution import attribute, spearman

DAMAGED = "model.layers.1.self_attn.k_proj"  # not among draft's most sensitive layers at 8 bits


@pytest.fixture(scope="module")
def damaged_artifact(tmp_path_factory, draft_dir):
    """draft at 8 bits everywhere but one linear, at 2 bits."""
    from optkit.quant.mixed_artifact import write_mixed_artifact
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    root = tmp_path_factory.mktemp("attribution")
    quantize_model(draft_dir, root / "w8", QuantizeOptions(weights=WeightScheme(bits=8, group_size=128)))
    write_mixed_artifact(root / "w8", draft_dir, {DAMAGED: "w2g128"}, root / "damaged", {})
    return root / "damaged"


def test_attribution_ranks_a_deliberately_damaged_layer_first(damaged_artifact, draft_dir):
    found = attribute(damaged_artifact, draft_dir, windows=2, seq_len=128, exact=-1)
    assert found.layers[0].name == DAMAGED
    assert max(found.layers, key=lambda x: x.exact).name == DAMAGED
    assert found.layers[0].estimate > 0.5 * found.kld  # it causes most of the KLD
    assert found.spearman is not None and found.spearman > 0.5
    top = found.to_json()["layers"][0]
    assert top["name"] == DAMAGED and 0.5 < top["share"] <= 1.5


def test_moves_to_finer_rungs_keep_what_their_error_keeps(damaged_artifact, draft_dir):
    """A move's estimated drop is the full-precision drop less the share of the error the rung keeps
    (module doc): it rises with the rung, never past the drop to full precision."""
    from optkit.quant.ladder import parse_rung

    rungs = [parse_rung(x) for x in ("w3g128", "w4g128", "w4g32", 8)]
    found = attribute(damaged_artifact, draft_dir, windows=2, seq_len=128, exact=1, rungs=rungs)
    top = found.layers[0]
    assert top.name == DAMAGED and list(top.moves) == ["w3g128", "w4g128", "w4g32", "w8g128"]
    drops = list(top.moves.values())
    assert 0 < drops[0] < drops[1] < drops[2] < drops[3] <= top.estimate
    assert top.estimate_8bit == drops[3]
    assert all(not layer.moves for layer in found.layers[1:])  # already 8-bit: no rung above but 16


def test_heldout_windows_are_the_calibration_draw_complement(draft_dir):
    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import tokenize_stream
    from optkit.modeldir import load_tokenizer
    from optkit.quant.calibration_data import CalibrationOptions, calibration_data

    tokenizer = load_tokenizer(draft_dir)
    options = CalibrationOptions(num_samples=64, seq_len=128, seed=3)
    taken = calibration_data(tokenizer, options).tokens
    stream = torch.cat([tokenize_stream(tokenizer, [t]) for t in load_text_set("calib").texts])
    starts = sampled_starts(stream.numel(), 128, 64, 3)
    assert torch.equal(torch.stack([stream[s : s + 128] for s in starts.tolist()]), taken)  # the same draw
    windows = uncovered_windows(stream, starts, 128, 64, 16)
    assert windows.shape == (16, 64)
    covered = torch.zeros(stream.numel(), dtype=torch.bool)
    for s in starts.tolist():
        covered[s : s + 128] = True
    for window in windows:  # every window lies where no calibration sample reads
        where = (stream.unfold(0, 64, 1) == window).all(-1).nonzero().flatten().tolist()
        assert any(not covered[w : w + 64].any() for w in where)


def test_uncovered_windows_refuses_a_fully_read_stream():
    from optkit.errors import OptkitError

    with pytest.raises(OptkitError, match="calibration read every window"):
        uncovered_windows(torch.arange(100), torch.tensor([0, 50]), 50, 10, 4)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)  # ties share their rank
