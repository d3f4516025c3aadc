"""Per-layer precision in compressed-tensors and GPTQ checkpoints (quant/formats/mixed.py), written
from a uniform artifact with only the raised layers re-quantized (quant/mixed_artifact.py): other
bit widths, other group sizes (quant/ladder.py's rungs) and full precision in one checkpoint."""

import json
import re

import pytest
import torch

from optkit.quant.formats import get_format
from optkit.quant.formats.mixed import fused_units, layer_schemes
from optkit.quant.mixed_artifact import write_mixed_artifact

QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
DOWN = "model.layers.1.mlp.down_proj"
GATE_UP = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]  # to 4-bit g32: a finer group
O_PROJ = "model.layers.1.self_attn.o_proj"  # to 4-bit per channel


@pytest.fixture(scope="module", params=["compressed-tensors", "gptq"])
def mixed(request, tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    root = tmp_path_factory.mktemp(request.param)
    quantize_model(draft_dir, root / "w4", QuantizeOptions(format=request.param))
    write_mixed_artifact(root / "w4", draft_dir, dict.fromkeys(QKV, 8), root / "step1", {})
    write_mixed_artifact(root / "step1", draft_dir, {DOWN: 16}, root / "mixed", {"repair": {"note": "test"}})
    moves = {**dict.fromkeys(GATE_UP, "w4g32"), O_PROJ: "w4ch"}
    write_mixed_artifact(root / "mixed", draft_dir, moves, root / "groups", {})
    return request.param, root


def test_raised_layers_hold_their_precision_and_the_rest_is_untouched(mixed, draft_dir):
    from optkit.quant.formats.load import load_model
    from optkit.quant.methods.rtn.math import rtn_quantize
    from optkit.weights.schemes import WeightScheme

    name, root = mixed
    model, uniform, base = load_model(root / "mixed"), load_model(root / "w4"), load_model(draft_dir)
    for layer in QKV:  # 8-bit RTN of the base weight, at the artifact's group size
        expected = rtn_quantize(base.get_submodule(layer).weight, WeightScheme(bits=8, group_size=128)).dequantize()
        assert torch.equal(model.get_submodule(layer).weight, expected)
    assert torch.equal(model.get_submodule(DOWN).weight, base.get_submodule(DOWN).weight)
    other = "model.layers.1.self_attn.k_proj"
    assert torch.equal(model.get_submodule(other).weight, uniform.get_submodule(other).weight)
    manifest = json.loads((root / "mixed" / "optkit.json").read_text())
    eight = {"bits": 8, "group_size": 128}
    assert manifest["precision_overrides"] == {**dict.fromkeys(QKV, eight), DOWN: {"bits": 16}}  # earlier step kept
    assert manifest["repair"] == {"note": "test"}


def test_the_config_says_which_layer_has_which_scheme(mixed):
    name, root = mixed
    config = json.loads((root / "mixed" / "config.json").read_text())["quantization_config"]
    prefixes = [*QKV, "model.layers.1.self_attn.o_proj"]
    schemes = layer_schemes(get_format(name), config, prefixes)
    assert [schemes[p].bits for p in prefixes] == [8, 8, 8, 4]
    if name == "compressed-tensors":
        assert DOWN in config["ignore"] and list(config["config_groups"])[-1] == "group_0"
        assert sorted(config["config_groups"]["group_w8g128"]["targets"]) == sorted(QKV)
    else:  # gptqmodel's dynamic overrides; vLLM matches the fused qkv_proj by the same pattern
        (plus,) = [k for k in config["dynamic"] if k.startswith("+:")]
        (minus,) = [k for k in config["dynamic"] if k.startswith("-:")]
        assert config["dynamic"][plus] == {"bits": 8} and config["dynamic"][minus] == {}
        for module in [*QKV, "model.layers.0.self_attn.qkv_proj"]:
            assert re.match(plus[2:], module)
        assert not re.match(plus[2:], "model.layers.0.self_attn.o_proj")
        assert re.match(minus[2:], DOWN) and not re.match(minus[2:], "model.layers.11.mlp.down_proj")


def test_fused_units_follow_vllm():
    names = [*QKV, "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert fused_units(names) == [QKV, [names[3]], names[4:]]


def test_a_finer_group_is_a_rung_of_its_own(mixed, draft_dir):
    """4-bit g32 and 4-bit per channel beside the artifact's 4-bit g128, 8 bits and full precision:
    each layer holds RTN on its rung, the config names each scheme, earlier moves are kept."""
    from optkit.quant.formats.load import load_model
    from optkit.quant.methods.rtn.math import rtn_quantize
    from optkit.weights.schemes import WeightScheme

    name, root = mixed
    model, base = load_model(root / "groups"), load_model(draft_dir)
    for layer, scheme in [
        *((x, WeightScheme(bits=4, group_size=32)) for x in GATE_UP),
        (O_PROJ, WeightScheme(group_size=-1)),
    ]:
        expected = rtn_quantize(base.get_submodule(layer).weight, scheme).dequantize()
        assert torch.equal(model.get_submodule(layer).weight, expected), layer
    assert torch.equal(model.get_submodule(DOWN).weight, base.get_submodule(DOWN).weight)
    config = json.loads((root / "groups" / "config.json").read_text())["quantization_config"]
    prefixes = [*QKV, *GATE_UP, O_PROJ, "model.layers.1.mlp.up_proj"]
    schemes = layer_schemes(get_format(name), config, prefixes)
    assert [(schemes[p].bits, schemes[p].group_size) for p in prefixes] == [(8, 128)] * 3 + [(4, 32)] * 2 + [
        (4, -1),
        (4, 128),
    ]
    manifest = json.loads((root / "groups" / "optkit.json").read_text())
    assert manifest["precision_overrides"][O_PROJ] == {"bits": 4, "group_size": -1}
    assert len(manifest["precision_overrides"]) == 7
    if name == "compressed-tensors":  # the per-channel group as compressed-tensors spells it
        weights = config["config_groups"]["group_w4ch"]["weights"]
        assert weights["strategy"] == "channel" and weights["group_size"] is None
    else:  # a different group size is written out, the same one left to the top level
        overrides = [v for k, v in config["dynamic"].items() if k.startswith("+:")]
        assert {"bits": 4, "group_size": 32} in overrides and {"bits": 8} in overrides


def test_a_mixed_group_checkpoint_loads_in_transformers_as_in_the_runtime(mixed, monkeypatch):
    from optkit.compat.transformers_load import check_transformers_load

    name, root = mixed
    if name != "compressed-tensors":
        pytest.skip("transformers loads GPTQ only through gptqmodel: the check runs on compressed-tensors, the default")
    monkeypatch.setenv("OPTKIT_CPU_INT4", "0")  # the reference path: the question is the per-layer schemes
    check = check_transformers_load(root / "groups")
    assert check.ok, check.problems


# from a 2-bit artifact (repair's `start: smallest` with the default ladder): every layer moved up,
# one to a finer 2-bit group, so the checkpoint holds five quantized schemes and full precision
UP = {
    **dict.fromkeys(QKV, "w4g128"),
    **dict.fromkeys(GATE_UP, "w2g32"),
    O_PROJ: "w3ch",
    "model.layers.0.mlp.down_proj": 8,  # 8 bits at the artifact's group size: w8g64
    DOWN: 16,
}


@pytest.fixture(scope="module", params=["compressed-tensors", "gptq"])
def from_two_bits(request, tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    root = tmp_path_factory.mktemp(f"{request.param}-w2")
    options = QuantizeOptions(format=request.param, weights=WeightScheme(bits=2, group_size=64))
    quantize_model(draft_dir, root / "w2", options)
    write_mixed_artifact(root / "w2", draft_dir, UP, root / "mixed", {})
    return request.param, root


def test_a_2_bit_artifact_raised_along_the_ladder_holds_each_rung(from_two_bits, draft_dir):
    from optkit.quant.formats.load import load_model
    from optkit.quant.ladder import parse_rung
    from optkit.quant.methods.rtn.math import rtn_quantize
    from optkit.weights.schemes import WeightScheme

    name, root = from_two_bits
    model, uniform, base = load_model(root / "mixed"), load_model(root / "w2"), load_model(draft_dir)
    two = WeightScheme(bits=2, group_size=64)
    for layer, value in UP.items():
        rung = parse_rung(value)
        weight = base.get_submodule(layer).weight
        expected = weight if rung.full else rtn_quantize(weight, rung.scheme(two)).dequantize()
        assert torch.equal(model.get_submodule(layer).weight, expected), layer
    other = "model.layers.1.self_attn.k_proj"  # still on the artifact's 2-bit g64
    assert torch.equal(model.get_submodule(other).weight, uniform.get_submodule(other).weight)
    assert torch.equal(
        uniform.get_submodule(other).weight, rtn_quantize(base.get_submodule(other).weight, two).dequantize()
    )
    config = json.loads((root / "mixed" / "config.json").read_text())["quantization_config"]
    prefixes = [*QKV, *GATE_UP, O_PROJ, "model.layers.0.mlp.down_proj", other]
    schemes = layer_schemes(get_format(name), config, prefixes)
    assert [(schemes[p].bits, schemes[p].group_size) for p in prefixes] == [(4, 128)] * 3 + [(2, 32)] * 2 + [
        (3, -1),
        (8, 64),
        (2, 64),
    ]
    if name == "compressed-tensors":
        assert config["config_groups"]["group_0"]["weights"]["num_bits"] == 2
        assert config["config_groups"]["group_w2g32"]["weights"]["num_bits"] == 2 and DOWN in config["ignore"]
    else:
        assert config["bits"] == 2 and {"bits": 2, "group_size": 32} in config["dynamic"].values()


def test_the_runtime_computes_what_the_evaluation_loader_computes_on_a_2_bit_mix(from_two_bits, monkeypatch):
    """optkit's runtime keeps each layer packed at its own bits (2, 3, 4 and 8 in one model) and
    matches the dequantized model the gate evaluates."""
    from optkit.compat.transformers_load import runtime_logits, sample_sequences
    from optkit.quant.formats.load import load_model

    name, root = from_two_bits
    monkeypatch.setenv("OPTKIT_CPU_INT4", "0")
    model = load_model(root / "mixed").float()
    sequences = sample_sequences(model.config.vocab_size)
    with torch.inference_mode():
        expected = [model(torch.tensor([s])).logits[0].float() for s in sequences]
    got = runtime_logits(root / "mixed", sequences)
    scale = max(e.abs().max().item() for e in expected)
    assert max((g - e).abs().max().item() for g, e in zip(got, expected, strict=True)) <= 1e-3 + 1e-4 * scale


def test_a_2_bit_mix_loads_in_transformers_as_in_the_runtime(from_two_bits, monkeypatch):
    from optkit.compat.transformers_load import check_transformers_load

    name, root = from_two_bits
    if name != "compressed-tensors":
        pytest.skip("transformers loads GPTQ only through gptqmodel: the check runs on compressed-tensors, the default")
    monkeypatch.setenv("OPTKIT_CPU_INT4", "0")
    check = check_transformers_load(root / "mixed")
    assert check.ok, check.problems
