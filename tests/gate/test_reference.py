import torch

from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.gate import evaluate as evaluate_module
from optkit.gate.evaluate import evaluate
from optkit.gate.metrics import full_kld, reference_from_logits, topk_kld
from optkit.gate.options import GateOptions
from optkit.modeldir import load_tokenizer
from optkit.quant.formats.load import load_model
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme


def test_topk_kld_is_a_close_lower_bound_of_the_full_kld(tmp_path, small_dir):
    """The error of the cached (top-k + tail) KLD against the full-vocabulary KLD, measured."""
    quantize_model(small_dir, tmp_path / "q", QuantizeOptions(weights=WeightScheme(bits=3, symmetric=False)))
    windows = pack_windows(tokenize_stream(load_tokenizer(small_dir), load_text_set("heldout").texts), 256, 16)
    with torch.inference_mode():
        base, artifact = load_model(small_dir)(windows).logits, load_model(tmp_path / "q")(windows).logits
    full = full_kld(base[:, :-1], artifact[:, :-1])
    log_q = torch.log_softmax(artifact[:, :-1].float(), dim=-1)
    errors = {}
    for k in (256, 1024):
        approx = topk_kld(reference_from_logits(base, windows, k), log_q)
        assert (approx <= full + 1e-5).all()  # merging outcomes never increases a divergence
        errors[k] = 1 - approx.mean().item() / full.mean().item()
    assert 0 <= errors[1024] < errors[256] < 0.10
    assert errors[1024] < 0.03


def test_with_the_reference_cache_a_second_gate_does_not_load_the_base(tmp_path, draft_dir, monkeypatch):
    quantize_model(draft_dir, tmp_path / "q", QuantizeOptions())
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    loaded = []
    real_load = evaluate_module.load_model

    def spy(path, *args, **kwargs):
        loaded.append(str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(evaluate_module, "load_model", spy)
    first = evaluate(tmp_path / "q", draft_dir, GateOptions(max_windows=8, reference_cache=True))
    assert str(draft_dir) in loaded and first.eval_set["base_model_loaded"]
    loaded.clear()
    second = evaluate(tmp_path / "q", draft_dir, GateOptions(max_windows=8, reference_cache=True))
    assert loaded == [str(tmp_path / "q")] and not second.eval_set["base_model_loaded"]
    assert second.metrics == first.metrics
    exact = evaluate(tmp_path / "q", draft_dir, GateOptions(max_windows=8))
    assert exact.metrics["ppl_base"] == first.metrics["ppl_base"]
    assert exact.metrics["kld_mean"] >= first.metrics["kld_mean"]
