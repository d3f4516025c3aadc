"""Mixture-of-experts quantization (quant/moe.py, families/mixtral.py and qwen_moe.py) on tiny
random Mixtral, Qwen2-MoE (shared expert, one dense layer) and Qwen3-MoE models."""

import json
import logging

import pytest
import torch
from safetensors import safe_open

from optkit.compat.vllm_spec import check_vllm_spec, moe_problems
from optkit.gate.metrics import full_kld
from optkit.kernels import cpu_int4
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.models.paged import run_paged, whole_prefills
from tests.tiny_families import TINY, save_tiny_family

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
CALIB = CalibrationOptions(num_samples=8, seq_len=64)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, draft_dir):
    made = {}

    def make(name: str):
        if name not in made:
            made[name] = save_tiny_family(name, tmp_path_factory.mktemp("moe") / name, draft_dir)
        return made[name]

    return make


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_calibration_block_computes_what_transformers_fused_experts_do(moe_model, family):
    """The per-expert calibration block, loaded from the checkpoint's keys, gives transformers'
    layer outputs, whether every token goes through every expert or only the routed ones."""
    from transformers import AutoModelForCausalLM

    from optkit.quant.calibrate import LayerStream

    path = moe_model(family)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        states = reference(tokens, output_hidden_states=True).hidden_states
    for mode in ("all", "routed"):
        stream = LayerStream(path, torch.device("cpu"), mode)
        rope = stream.position_embeddings(tokens.shape[1])
        with torch.no_grad():
            for index in range(stream.num_layers - 1):  # the last hidden state is after the final norm
                layer = stream.load_layer(index)
                out = layer(states[index], position_embeddings=rope, attention_mask=None)
                out = out[0] if isinstance(out, tuple) else out
                torch.testing.assert_close(out, states[index + 1], rtol=1e-4, atol=1e-5)
                stream.release_layer(index)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize(
    "method", ["rtn", "gptq", pytest.param("awq", marks=pytest.mark.slow), pytest.param("w8a8", marks=pytest.mark.slow)]
)
def test_every_expert_is_quantized_and_the_gates_stay_full_precision(tmp_path, moe_model, family, method):
    bits = 8 if method == "w8a8" else 4
    scheme = WeightScheme(bits=8, group_size=-1) if method == "w8a8" else WeightScheme(bits=bits, group_size=64)
    out = tmp_path / "artifact"
    manifest = quantize_model(moe_model(family), out, QuantizeOptions(method=method, weights=scheme, calibration=CALIB))
    tensors = _tensors(out)
    marker = "weight" if method == "w8a8" else "weight_packed"
    num_experts, sparse_layers = 4, (0, 1) if family != "qwen2_moe" else (0,)
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    linears = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    quantized = {layer["name"] for layer in manifest["layers"]}
    for i in sparse_layers:
        for e in range(num_experts):
            for linear in linears:
                name = f"model.layers.{i}.{block}.experts.{e}.{linear}"
                assert name in quantized
                assert tensors[f"{name}.{marker}"].dtype in (torch.int32, torch.int8)
                assert f"{name}.weight_scale" in tensors
        gate = tensors[f"model.layers.{i}.{block}.gate.weight"]
        assert gate.dtype == torch.float32 and gate.shape == (num_experts, TINY["hidden_size"])
    # no tensor of an expert is left in full precision
    full = [k for k, t in tensors.items() if ".experts." in k and t.is_floating_point() and k.endswith(".weight")]
    assert full == []
    config = json.loads((out / "config.json").read_text())
    listed = config["quantization_config"]["ignore"]
    # vLLM reads every expert by these names, with a dense linear's tensors
    shapes = {layer["name"]: tuple(layer["shape"]) for layer in manifest["layers"]}
    assert check_vllm_spec(config, tensors, shapes) == []
    without_expert_1 = {k: v for k, v in tensors.items() if ".experts.1." not in k}
    assert any(".experts.1." in p for p in moe_problems(config, without_expert_1))
    assert f"model.layers.0.{block}.gate" in listed
    if family == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert_gate" in listed
        assert tensors["model.layers.0.mlp.shared_expert_gate.weight"].dtype == torch.float32
        assert "model.layers.0.mlp.shared_expert.down_proj.weight_scale" in tensors
        assert "model.layers.1.mlp.down_proj.weight_scale" in tensors  # the dense layer (mlp_only_layers)


def test_routed_calibration_falls_back_to_rtn_for_experts_with_too_few_tokens(tmp_path, moe_model, caplog):
    options = QuantizeOptions(
        method="gptq",
        weights=WeightScheme(bits=4, group_size=64),
        calibration=CalibrationOptions(num_samples=4, seq_len=64, moe_calibration="routed"),
    )
    with caplog.at_level(logging.WARNING, logger="optkit.quant.layer_step"):
        manifest = quantize_model(moe_model("qwen3_moe"), tmp_path / "routed", options)
    experts = [layer for layer in manifest["layers"] if ".experts." in layer["name"]]
    # 256 tokens, 2 of 4 experts each: every expert gets fewer than 2 × 128 = 256 tokens
    assert all(layer["calibration_tokens"] == layer["routed_tokens"] < 256 for layer in experts)
    assert all(layer["fallback"] == "rtn" for layer in experts)
    warned = [r.getMessage() for r in caplog.records if "quantized with RTN" in r.getMessage()]
    assert len(warned) == len(experts)
    assert warned[0].startswith("model.layers.0.mlp.experts.0.gate_proj: ")
    # by default every token reaches every expert: GPTQ everywhere
    default = quantize_model(
        moe_model("qwen3_moe"),
        tmp_path / "all",
        options.model_copy(update={"calibration": CalibrationOptions(num_samples=4, seq_len=64)}),
    )
    experts = [layer for layer in default["layers"] if ".experts." in layer["name"]]
    assert all(layer["calibration_tokens"] == 256 and "fallback" not in layer for layer in experts)
    # the manifest says how each token counted
    assert manifest["calibration"]["moe_calibration"] == "routed"
    assert default["calibration"]["moe_token_weights"].startswith("every token, c_te = (p_te / sum of the top-k")
    # each token goes to 2 experts: their routed counts add up to twice the tokens
    assert (
        sum(layer["routed_tokens"] for layer in experts if layer["name"].startswith("model.layers.0.")) == 3 * 2 * 256
    )


class _MoELayer(torch.nn.Module):
    """A decoder layer that is only a Mixtral MoE block (what LayerWork runs)."""

    def __init__(self, mode: str, top_k: int):
        from optkit.families.mixtral import MIXTRAL
        from optkit.quant.moe import CalibrationMoE

        super().__init__()
        config = {"hidden_size": 6, "num_local_experts": 3, "num_experts_per_tok": top_k, "intermediate_size": 5}
        self.mlp = CalibrationMoE(MIXTRAL.moe, config, mode)

    def forward(self, x, position_embeddings=None, attention_mask=None):
        return self.mlp(x)


def _expert_hessians(mode: str, top_k: int, x: torch.Tensor) -> tuple[_MoELayer, dict[str, torch.Tensor]]:
    from optkit.quant.calibrate import LayerWork
    from optkit.quant.methods.gptq.step import capture_hessians

    torch.manual_seed(1)
    layer = _MoELayer(mode, top_k)
    work = LayerWork(layer, "model.layers.0", x, (None, None), 2, torch.device("cpu"), set(), lambda *a: None)
    names = [f"mlp.experts.{e}.{n}" for e in range(3) for n in ("w1", "w3")]
    with torch.inference_mode():
        return layer, {**capture_hessians(work, names), **capture_hessians(work, ["mlp.experts.0.w2"])}


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_default_calibration_weighs_each_expert_hessian_by_the_router(top_k):
    """H_e = 2/N Σ_t c_te x_t x_tᵀ over every token, c_te = (p_te / Σ_{top-k} p_t)²: a routed
    token counts with its squared routing weight, the others with the weight they would have had
    (Mixtral renormalizes). With top-1 that is exp(2 (l_te − max_e l_te)) of the router logits l."""
    x = torch.randn(4, 7, 6)  # [N, L, hidden]: 28 tokens, 2 samples per batch
    layer, weighted = _expert_hessians("all", top_k, x)
    flat = x.reshape(-1, 6)
    logits = flat @ layer.mlp.gate.weight.T  # [T, E]
    probs = torch.softmax(logits, dim=-1)
    c = (probs / probs.topk(top_k, dim=-1).values.sum(-1, keepdim=True)) ** 2
    if top_k == 1:
        torch.testing.assert_close(c, torch.exp(2 * (logits - logits.amax(-1, keepdim=True))))
    chosen = probs.topk(top_k, dim=-1).indices
    for e in range(3):
        expected = 2 * (flat * c[:, e, None]).T @ flat / flat.shape[0]
        torch.testing.assert_close(weighted[f"mlp.experts.{e}.w1"], expected, rtol=1e-5, atol=1e-6)
        assert weighted[f"mlp.experts.{e}.w3"] is weighted[f"mlp.experts.{e}.w1"]  # gate/up: one Hessian
    # the down projection: its inputs (the expert's intermediate activations), weighted alike
    expert = layer.mlp.experts[0]
    h = torch.nn.functional.silu(expert.w1(flat)) * expert.w3(flat)
    torch.testing.assert_close(
        weighted["mlp.experts.0.w2"], 2 * (h * c[:, 0, None]).T @ h / h.shape[0], rtol=1e-5, atol=1e-6
    )

    def direction(h: torch.Tensor) -> torch.Tensor:  # GPTQ is blind to H's scale: compare shapes
        return h / h.trace()

    _, routed = _expert_hessians("routed", top_k, x)
    for e in range(3):
        mine = flat[(chosen == e).any(-1)]
        torch.testing.assert_close(routed[f"mlp.experts.{e}.w1"], 2 * mine.T @ mine / mine.shape[0])
        uniform = 2 * flat.T @ flat / flat.shape[0]
        for other in (routed[f"mlp.experts.{e}.w1"], uniform):
            gap = (direction(weighted[f"mlp.experts.{e}.w1"]) - direction(other)).abs().max()
            assert gap > 1e-3 * direction(other).abs().max()


def test_awq_sees_each_expert_input_scaled_by_its_routing_weight():
    """capture_inputs(weighted=True), what AWQ's expert searches use: an expert's inputs come
    scaled by √c_te = q_te, so a linear's squared output error on them is c_te ‖Δf(x_t)‖²."""
    from optkit.quant.calibrate import LayerWork, capture_inputs

    torch.manual_seed(2)
    layer = _MoELayer("all", top_k=2)
    x = torch.randn(3, 5, 6)
    work = LayerWork(layer, "model.layers.0", x, (None, None), 2, torch.device("cpu"), set(), lambda *a: None)
    names = ["mlp.experts.1.w2", "mlp.experts.2.w1"]
    with torch.inference_mode():
        weighted = capture_inputs(work, names, num_samples=3, weighted=True)
        plain = capture_inputs(work, names, num_samples=3)
    flat = x.reshape(-1, 6)
    probs = torch.softmax(flat @ layer.mlp.gate.weight.T, dim=-1)
    q = probs / probs.topk(2, dim=-1).values.sum(-1, keepdim=True)
    expert = layer.mlp.experts[1]
    h = torch.nn.functional.silu(expert.w1(flat)) * expert.w3(flat)
    torch.testing.assert_close(plain["mlp.experts.1.w2"].reshape(-1, 5), h)
    torch.testing.assert_close(weighted["mlp.experts.1.w2"].reshape(-1, 5), h * q[:, 1, None])
    torch.testing.assert_close(weighted["mlp.experts.2.w1"].reshape(-1, 6), flat * q[:, 2, None])


def test_an_unknown_moe_calibration_mode_names_the_choices():
    with pytest.raises(ValueError, match="choose one of all, routed"):
        CalibrationOptions(moe_calibration="every")


def _runtime_logits(path, sequences) -> torch.Tensor:
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(path)
    return torch.cat(run_paged(model, sequences, whole_prefills([len(s) for s in sequences]), block_size=16))


def _sequences(model) -> list[list[int]]:
    """Held-out text (not the calibration set's), as the gate measures: random ids would be out of
    the distribution GPTQ calibrates on."""
    from optkit.data.eval_sets import load_text_set
    from optkit.modeldir import load_tokenizer

    ids = load_tokenizer(model).encode("\n".join(load_text_set("heldout").texts[:20]))
    return [ids[i * 64 : (i + 1) * 64] for i in range(6)]


def _mean_kld(base, artifact) -> float:
    sequences = _sequences(base)
    return full_kld(_runtime_logits(base, sequences), _runtime_logits(artifact, sequences)).mean().item()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_quality_rtn_w8_within_the_gate_and_gptq_w4_below_rtn_w4(tmp_path, moe_model, family):
    base = moe_model(family)
    w8 = quantize_model(
        base, tmp_path / "rtn8", QuantizeOptions(method="rtn", weights=WeightScheme(bits=8, group_size=64))
    )
    assert _mean_kld(base, tmp_path / "rtn8") <= 1e-3, w8["layers"][0]
    w4 = WeightScheme(bits=4, group_size=64)
    quantize_model(base, tmp_path / "rtn4", QuantizeOptions(method="rtn", weights=w4))
    # 32 x 64 tokens: the router-weighted statistics (quant/moe.py) count a token by its squared
    # routing weight, so 8 x 64 leave the tiny Qwen3-MoE's GPTQ at RTN's KLD (0.01403 vs 0.01389;
    # 0.01084 at 32 x 64, mixtral 0.00991 vs 0.01585, qwen2_moe 0.00419 vs 0.00876)
    calibration = CalibrationOptions(num_samples=32, seq_len=64)
    quantize_model(base, tmp_path / "gptq4", QuantizeOptions(method="gptq", weights=w4, calibration=calibration))
    assert _mean_kld(base, tmp_path / "gptq4") < _mean_kld(base, tmp_path / "rtn4")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_runtime_on_an_artifact_matches_the_dequantized_reference_of_its_own_tensors(tmp_path, moe_model, family):
    """transformers cannot load quantized MoE artifacts faithfully (optkit/compat/matrix.py): the
    reference is the transformers model with per-expert linears holding the artifact's dequantized
    tensors (quant/formats/load.py, what the gate evaluates), against optkit's runtime."""
    from optkit.quant.formats.load import load_model

    out = tmp_path / "w8a8"
    quantize_model(
        moe_model(family),
        out,
        QuantizeOptions(method="w8a8", weights=WeightScheme(bits=8, group_size=-1), calibration=CALIB),
    )
    sequences = _sequences(out)
    reference = load_model(out)
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([s])).logits[0] for s in sequences])
    diff = (_runtime_logits(out, sequences) - expected).abs().amax(dim=-1)  # per token
    # equal up to float rounding, except where rounding flips a near-tie between two experts (that
    # token's K and V then move the rest of its sequence a little): at most 1% of tokens start a run
    moved = (diff > 1e-4).view(len(sequences), -1)
    starts = moved & ~torch.nn.functional.pad(moved[:, :-1], (1, 0))
    assert starts.float().mean() <= 0.01 and diff.max() <= 5e-2, diff.topk(5)


def test_the_matrix_says_transformers_cannot_load_quantized_moe_artifacts_and_why():
    from optkit.compat import matrix
    from optkit.quant.formats.kind import ArtifactKind

    kind = ArtifactKind("compressed-tensors", 4, True)
    versions = {"transformers": "5.24.0", "compressed-tensors": "0.20.1"}
    for model_type in MOE_FAMILIES:
        assert matrix.expected_status(kind, matrix.TRANSFORMERS, versions, model_type) == "fails"
        rows = dict(matrix.where_it_loads(kind, versions, model_type))
        assert "MoE experts fused" in rows[matrix.TRANSFORMERS] and rows[matrix.OPTKIT] == "loads"
        assert rows[matrix.VLLM].startswith("by spec")
    assert matrix.expected_status(kind, matrix.TRANSFORMERS, versions, "llama") == "loads"


def test_quantize_router_quantizes_the_routers_and_the_runtime_serves_them(tmp_path, moe_model):
    """Off by default (above); with quantize_router the routers are quantized linears like the
    experts (listed in the manifest, packed in the artifact, not in the ignore list), the
    shared-expert gate stays in full precision, and the runtime matches the dequantized reference."""
    from optkit.quant.formats.load import load_model

    out = tmp_path / "router"
    options = QuantizeOptions(
        method="gptq", weights=WeightScheme(bits=4, group_size=64), calibration=CALIB, quantize_router=True
    )
    manifest = quantize_model(moe_model("qwen2_moe"), out, options)
    tensors = _tensors(out)
    router = "model.layers.0.mlp.gate"
    assert router in {layer["name"] for layer in manifest["layers"]}
    assert tensors[f"{router}.weight_packed"].dtype == torch.int32 and f"{router}.weight" not in tensors
    listed = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert router not in listed and "model.layers.0.mlp.shared_expert_gate" in listed
    assert tensors["model.layers.0.mlp.shared_expert_gate.weight"].dtype == torch.float32
    sequences = _sequences(out)
    with torch.no_grad():
        expected = torch.cat([load_model(out)(torch.tensor([s])).logits[0] for s in sequences])
    with cpu_int4.reference_only():  # the artifact's semantics; the int4 kernel is bounded in tests/models
        diff = (_runtime_logits(out, sequences) - expected).abs().amax(dim=-1)
    # equal up to float rounding, except where rounding flips a near-tie between two experts
    assert (diff > 1e-4).float().mean() <= 0.01 and diff.max() <= 5e-2, diff.topk(5)


def test_quantize_router_on_a_dense_model_is_refused_in_one_line(tmp_path, draft_dir):
    from optkit.errors import OptkitError

    with pytest.raises(OptkitError, match="not a mixture of experts and has no router"):
        quantize_model(draft_dir, tmp_path / "out", QuantizeOptions(quantize_router=True))
    assert not (tmp_path / "out").exists()
