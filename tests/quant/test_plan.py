"""`optkit quantize --dry-run` (quant/plan.py): the plan comes from config.json and the safetensors
headers alone, groups the linears as the pipeline takes them, says what stays and why, and predicts
the artifact's size."""

import json

import pytest

from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.methods.gptq.options import GPTQOptions
from optkit.quant.plan import plan_quantization
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import W8_PER_CHANNEL, WeightScheme
from tests.tiny_families import TINY, save_tiny_family

CALIB = CalibrationOptions(num_samples=4, seq_len=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, draft_dir):
    made = {}

    def make(name: str):
        if name not in made:
            made[name] = save_tiny_family(name, tmp_path_factory.mktemp("plan") / name, draft_dir)
        return made[name]

    return make


def test_phi3_plan_groups_the_fused_linears_and_says_what_stays(run_cli, tiny, tmp_path):
    code, out, err = run_cli("quantize", str(tiny("phi3")), "--method", "gptq", "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["family"], plan["model_type"], plan["method"]) == ("phi3", "phi3", "gptq")
    groups = [["self_attn.qkv_proj"], ["self_attn.o_proj"], ["mlp.gate_up_proj"], ["mlp.down_proj"]]
    assert plan["layers"] == [[f"model.layers.{i}", groups] for i in range(TINY["num_hidden_layers"])]
    kept = {k["what"]: k for k in plan["kept"]}
    assert kept["lm_head"]["names"] == ["lm_head.weight"] and kept["embeddings"]["count"] == 1
    assert kept["norms"]["count"] == 2 * TINY["num_hidden_layers"] + 1
    assert plan["peak_bytes"]["total"] > plan["peak_bytes"]["calibration_inputs"] > 0
    assert not list(tmp_path.iterdir())  # nothing written anywhere


def test_the_plan_reads_no_tensor(tiny, monkeypatch):
    import safetensors

    def refuse(*args, **kwargs):
        raise AssertionError("the dry run opened a tensor")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr("optkit.modeldir.safe_open", refuse)
    plan = plan_quantization(tiny("phi3"), QuantizeOptions(method="rtn"))
    assert plan.family == "phi3"


@pytest.mark.parametrize(
    "options",
    [
        dict(method="rtn", weights=WeightScheme(bits=4, group_size=64)),
        dict(method="rtn", weights=WeightScheme(bits=4, group_size=64, symmetric=False), format="awq"),
        dict(
            method="gptq", weights=WeightScheme(bits=4, group_size=32), gptq=GPTQOptions(act_order=True), format="gptq"
        ),
        dict(method="smoothquant", weights=WeightScheme(bits=8, group_size=-1), calibration=CALIB),
        dict(method="rtn", weights=WeightScheme(bits=4, group_size=64), head="int8"),
    ],
    ids=["ct-w4", "awq-w4-asym", "gptq-act-order", "w8a8", "ct-w4-head8"],
)
def test_the_expected_size_is_the_artifacts(tiny, tmp_path, options):
    options = QuantizeOptions(**{"calibration": CALIB, **options})
    plan = plan_quantization(tiny("phi3"), options)
    quantize_model(tiny("phi3"), tmp_path / "out", options)
    written = sum(p.stat().st_size for p in (tmp_path / "out").iterdir() if p.name != "optkit.json")
    assert abs(plan.artifact_bytes - written) <= 0.01 * written, (plan.artifact_bytes, written)
    assert plan.artifact_bytes < plan.base_bytes


def test_experts_are_grouped_and_routers_kept(tiny):
    plan = plan_quantization(tiny("mixtral"), QuantizeOptions(method="gptq"))
    assert plan.family == "mixtral"
    _, groups = plan.layers[0]
    experts = [g for g in groups if any(".experts." in n for n in g)]
    assert experts and all(len(g) == 2 * 4 or len(g) == 4 for g in experts)  # (w1, w3) or w2 of 4 experts
    routers = next(k for k in plan.kept if k.what.startswith("routers"))
    assert routers.count == TINY["num_hidden_layers"]


def test_quantize_without_out_asks_for_it(run_cli, tiny):
    code, _, err = run_cli("quantize", str(tiny("phi3")))
    assert code == 2 and "--out is missing" in err


def test_quantize_router_flag_plans_the_router_first_and_warns_transformers_cannot_load_it(run_cli, tiny):
    code, out, err = run_cli("quantize", str(tiny("mixtral")), "--method", "gptq", "--dry-run", "--json")
    assert code == 0, err
    assert "transformers" in err and "cannot load mixtral (mixture-of-experts)" in err  # the compat matrix's reason
    assert "model.layers.0.block_sparse_moe.gate" not in json.loads(out)["linears"]
    code, out, err = run_cli(
        "quantize", str(tiny("mixtral")), "--method", "gptq", "--quantize-router", "--dry-run", "--json"
    )
    assert code == 0, err
    plan = json.loads(out)
    assert plan["linears"]["model.layers.0.block_sparse_moe.gate"] == [4, TINY["hidden_size"]]
    groups = plan["layers"][0][1]
    first_expert_group = next(i for i, g in enumerate(groups) if any(".experts." in n for n in g))
    assert groups[first_expert_group - 1] == ["block_sparse_moe.gate"]  # routed by the quantized router
    code, _, err = run_cli("quantize", str(tiny("phi3")), "--quantize-router", "--dry-run")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "phi3 is not a mixture of experts" in errors[0]


def test_gptq_holds_one_hessian_per_distinct_input_of_a_group_plus_one_factor():
    """q/k/v share the attention's input and an expert's w1/w3 share theirs (one [in, in] each);
    distinct experts have their own; the factor of (H + λI)⁻¹ adds one of the widest."""
    from optkit.quant.methods import Workload
    from optkit.quant.methods.gptq.method import hessian_elements

    def _gptq_hessians(linears, layers):
        return hessian_elements(Workload(linears, layers, hidden_size=0, num_samples=0, seq_len=0))

    prefix = "model.layers.0"
    attention = {"self_attn.q_proj": (64, 32), "self_attn.k_proj": (16, 32), "self_attn.v_proj": (16, 32)}
    experts = {f"mlp.experts.{e}.{w}": (48, 32) for e in range(3) for w in ("w1", "w3")}
    down = {"mlp.down_proj": (32, 96)}
    linears = {f"{prefix}.{n}": shape for n, shape in {**attention, **experts, **down}.items()}
    layers = [(prefix, [list(attention), list(experts), list(down)])]
    assert _gptq_hessians(linears, layers) == max(32 * 32 + 32 * 32, 3 * 32 * 32 + 32 * 32, 96 * 96 + 96 * 96)
    assert _gptq_hessians(linears, [(prefix, [list(attention), list(experts)])]) == 4 * 32 * 32


def test_smoothquant_searches_hidden_wide_inputs_and_a_composition_takes_its_larger_stage(tiny):
    """SmoothQuant smooths only the norm-fed groups (inputs: the hidden states), AWQ also up → down
    (the intermediate width), and smoothquant+gptq smooths before GPTQ runs: not both at once."""
    model = tiny("llama")  # intermediate 256 > hidden 128

    def working(method: str) -> int:
        weights = {} if method == "awq" else {"weights": W8_PER_CHANNEL}  # the W8A8 stages' fixed scheme
        options = QuantizeOptions(method=method, calibration=CALIB, **weights)
        return plan_quantization(model, options).peak_bytes["working_set"]

    assert working("smoothquant") < working("awq")
    assert working("smoothquant+gptq") == max(working("smoothquant"), working("gptq"))
