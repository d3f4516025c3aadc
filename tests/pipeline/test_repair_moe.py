"""Attribution and repair on a mixture-of-experts model (a tiny random Mixtral): each expert's
w1/w2/w3 is a layer of its own, named as the checkpoint names it (`block_sparse_moe`, which
transformers 5 calls `mlp` and fuses into 3D parameters); the routers stay in full precision."""

import json

import pytest
import torch

from optkit.gate.options import GateOptions, RepairOptions
from optkit.manifest import read_manifest
from optkit.pipeline.repair import repair, size_mb
from tests.tiny_families import save_tiny_family

EXPERT = "model.layers.0.block_sparse_moe.experts.1.w2"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, draft_dir):
    return save_tiny_family("mixtral", tmp_path_factory.mktemp("moe") / "mixtral", draft_dir)


@pytest.fixture(scope="module")
def mixtral_w4(tmp_path_factory, mixtral):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("moe") / "w4"
    quantize_model(mixtral, out, QuantizeOptions())
    return out


def test_eval_attribute_scores_every_expert_linear(run_cli, mixtral, mixtral_w4):
    args = ("eval", mixtral_w4, "--baseline", mixtral, "--max-windows", "2", "--attribute", "--attribute-windows", "2")
    code, printed, _ = run_cli(*args, "--json")
    assert code == 0
    layers = {layer["name"]: layer for layer in json.loads(printed)["attribution"]["layers"]}
    assert layers.keys() == {layer["name"] for layer in read_manifest(mixtral_w4)["layers"]}
    experts = [n for n in layers if ".block_sparse_moe.experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (w1, w2, w3)
    assert not [n for n in layers if n.endswith(".gate")]  # routers: full precision, not ranked
    assert all(torch.isfinite(torch.tensor(layers[n]["estimate"])) for n in experts)
    assert sum(layers[n]["estimate"] for n in experts) > 0 and all(layers[n]["moves"] for n in experts)


def test_a_raised_expert_is_read_with_its_own_scheme(mixtral, mixtral_w4, tmp_path):
    """A mixed config names layers as the checkpoint does; the evaluation model must not dequantize
    an 8-bit expert with the artifact's 4-bit scheme because transformers calls its block `mlp`."""
    from optkit.modeldir import TensorReader
    from optkit.quant.formats.load import load_model
    from optkit.quant.methods.rtn.math import rtn_quantize
    from optkit.quant.mixed_artifact import write_mixed_artifact
    from optkit.weights.schemes import WeightScheme

    full = "model.layers.1.block_sparse_moe.experts.0.w1"
    write_mixed_artifact(mixtral_w4, mixtral, {EXPERT: 8, full: 16}, tmp_path / "mixed", {})
    model = load_model(tmp_path / "mixed")
    base = TensorReader(mixtral)
    eight = rtn_quantize(base.get(f"{EXPERT}.weight").float(), WeightScheme(bits=8, group_size=128)).dequantize()
    torch.testing.assert_close(model.get_submodule(EXPERT.replace("block_sparse_moe", "mlp")).weight, eight)
    torch.testing.assert_close(
        model.get_submodule(full.replace("block_sparse_moe", "mlp")).weight, base.get(f"{full}.weight").float()
    )


def test_repair_raises_experts_one_by_one_until_the_gate_passes(mixtral, mixtral_w4, tmp_path):
    from optkit.gate.evaluate import evaluate

    uniform = evaluate(mixtral_w4, mixtral, GateOptions(max_windows=4))
    target = 0.25 * uniform.metrics["kld_mean"]  # below uniform 4-bit: the experts must move too
    options = GateOptions(max_kld=target, max_windows=4, repair=RepairOptions(windows=4))
    outcome = repair(mixtral_w4, mixtral, options, tmp_path)
    assert outcome.passed and outcome.gate.metrics["kld_mean"] <= target
    experts = {n: r.label for n, r in outcome.raised.items() if ".block_sparse_moe.experts." in n}
    assert experts and len(experts) < 2 * 4 * 3  # some experts' linears, not all of them
    assert not [n for n in outcome.raised if n.endswith(".gate")]
    assert size_mb(outcome.artifact) < 1.5 * size_mb(mixtral_w4)
    again = evaluate(outcome.artifact, mixtral, options)  # the files give what repair measured
    assert again.metrics["kld_mean"] == pytest.approx(outcome.gate.metrics["kld_mean"], rel=1e-4)
