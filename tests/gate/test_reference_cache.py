"""The reference cache is keyed per window: another order or a subset of the windows still hits it."""

import torch

from optkit.gate import evaluate as evaluate_module
from optkit.gate.evaluate import evaluate
from optkit.gate.metrics import Reference
from optkit.gate.options import GateOptions
from optkit.gate.reference_cache import load_reference, reference_key, save_reference
from optkit.quant.quantize import QuantizeOptions, quantize_model


def _reference(windows: int, tokens: int = 5, k: int = 3) -> Reference:
    generator = torch.Generator().manual_seed(windows)
    return Reference(
        torch.randint(0, 50, (windows, tokens, k), generator=generator, dtype=torch.int32),
        torch.randn(windows, tokens, k, generator=generator),
        torch.rand(windows, tokens, generator=generator),
    )


def test_a_window_is_found_in_any_order_and_in_any_subset(tmp_path, draft_dir, monkeypatch):
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    windows = torch.arange(24).reshape(4, 6)
    key = reference_key(draft_dir, windows, 3)
    reference = _reference(4)
    save_reference(key, reference)
    order = [2, 0, 3]
    again = load_reference(reference_key(draft_dir, windows[order], 3))
    assert again is not None
    for field in ("topk_ids", "topk_logp", "target_nll"):
        assert torch.equal(getattr(again, field), getattr(reference, field)[order])
    assert load_reference(key.select(slice(1, 3))) is not None
    # another k, another base model or a window not seen: a miss, never a wrong answer
    assert load_reference(reference_key(draft_dir, windows, 4)) is None
    assert load_reference(reference_key(tmp_path / "cache", windows, 3)) is None
    assert load_reference(reference_key(draft_dir, windows + 1, 3)) is None


def test_a_damaged_window_entry_is_recomputed_not_trusted(tmp_path, draft_dir, monkeypatch):
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    windows = torch.arange(12).reshape(2, 6)
    key = reference_key(draft_dir, windows, 3)
    save_reference(key, _reference(2))
    entries = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(entries) == 2  # one per window, safetensors (never pickle)
    entries[0].write_bytes(b"not safetensors")
    assert load_reference(key) is None


def test_a_gate_on_fewer_windows_does_not_load_the_base(tmp_path, draft_dir, monkeypatch):
    """The first gate caches 8 windows; a gate on the first 4 (a subset) never runs the base."""
    quantize_model(draft_dir, tmp_path / "q", QuantizeOptions())
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    loaded = []
    real_load = evaluate_module.load_model

    def spy(path, *args, **kwargs):
        loaded.append(str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(evaluate_module, "load_model", spy)
    evaluate(tmp_path / "q", draft_dir, GateOptions(max_windows=8, reference_cache=True))
    loaded.clear()
    subset = evaluate(tmp_path / "q", draft_dir, GateOptions(max_windows=4, reference_cache=True))
    assert loaded == [str(tmp_path / "q")] and not subset.eval_set["base_model_loaded"]
