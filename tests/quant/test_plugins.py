"""The plug-in points work from outside optkit: a toy method and a toy format, registered here
(no file under optkit/ names them), quantize the draft model, load in the runtime and pass the gate."""

import json

import pytest
import torch

from optkit.kernels.packed_int import PackedIntLinear
from optkit.quant import methods
from optkit.quant.formats import format_names, reader_for, registered_format
from optkit.quant.methods.rtn.math import minmax_qparams, quantize
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme
from tests.models.paged import run_paged, whole_prefills
from tests.quant.toy_format import ToyFormat


def pow2_quantize(w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """Symmetric rounding onto a grid whose scales are powers of two (min/max scale rounded up)."""
    scale, zero_point = minmax_qparams(w, scheme, torch.float32)
    scale = torch.exp2(torch.ceil(torch.log2(scale))).to(scale_dtype)
    return QuantizedWeight(quantize(w, scale, zero_point, scheme), scale, zero_point, scheme)


POW2 = methods.Method(
    name="pow2", summary="round to nearest on power-of-two scales", quantize_weight=pow2_quantize, bits=(4, 8)
)


@pytest.fixture
def toy_plugins():
    with methods.registered_method(POW2), registered_format("toy", ToyFormat()):
        yield
    assert "pow2" not in methods.method_names() and "toy" not in format_names()


def test_a_registered_method_and_format_run_end_to_end(toy_plugins, run_cli, tmp_path, draft_dir):
    from optkit.gate.evaluate import evaluate
    from optkit.gate.options import GateOptions
    from optkit.kernels import cpu_int4
    from optkit.modeldir import read_config, read_tensors
    from optkit.models.loader import load_runtime_model
    from optkit.quant.formats.load import load_model

    code, out, _ = run_cli("quantize", "--help")
    assert code == 0 and "pow2" in out and "toy" in out

    artifact = tmp_path / "pow2"
    code, out, err = run_cli("quantize", draft_dir, "--method", "pow2", "--format", "toy", "--out", artifact, "--json")
    assert code == 0, err
    manifest = json.loads(out)
    assert manifest["method"] == "pow2" and manifest["format"] == "toy"
    quant_config = read_config(artifact)["quantization_config"]
    assert isinstance(reader_for(quant_config, "test"), ToyFormat)
    scales = [t for k, t in read_tensors(artifact).items() if k.endswith(".toy_scale")]
    assert scales and all(torch.equal(torch.exp2(torch.round(torch.log2(s))), s) for s in scales)

    runtime = load_runtime_model(artifact)  # optkit's runtime model (paged KV cache, packed-integer layers)
    # q/k/v and gate/up are fused at load (models/fusion.py): qkv, o, gate_up, down per layer
    assert sum(isinstance(m, PackedIntLinear) for m in runtime.modules()) == 4 * runtime.config.num_hidden_layers
    reference = load_model(artifact)  # transformers, with the format's dequantized weights
    sequence = list(range(1, 40))
    with torch.no_grad():
        expected = reference(torch.tensor([sequence])).logits[0].float()
    with cpu_int4.reference_only():  # the format's semantics, exactly (the int4 kernel: tests/models/test_loader.py)
        (got,) = run_paged(runtime, [sequence], whole_prefills([len(sequence)]))
    assert (got - expected).abs().max().item() < 1e-4

    result = evaluate(artifact, draft_dir, GateOptions(max_windows=4, max_kld=1.0, max_ppl_increase=100, min_top1=0))
    assert result.passed and 0 <= result.metrics["kld_mean"] < 1.0


def test_a_plugin_method_is_checked_by_its_constraints(toy_plugins):
    from optkit.quant.quantize import QuantizeOptions

    assert QuantizeOptions(method="pow2", format="toy", weights={"bits": 8}).method == "pow2"
    with pytest.raises(ValueError, match="pow2 quantizes to 4, 8 bits, not 3"):
        QuantizeOptions(method="pow2", weights={"bits": 3})


def test_after_unregistering_the_names_are_unknown():
    from optkit.quant.quantize import QuantizeOptions

    with pytest.raises(ValueError, match="unknown method 'pow2'"):
        QuantizeOptions(method="pow2")
    with pytest.raises(ValueError, match="unknown format 'toy'"):
        QuantizeOptions(format="toy")
