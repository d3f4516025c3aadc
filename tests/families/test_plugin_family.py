"""A dense family registered from outside optkit (tests/families/toy_family.py: no file of optkit
names it) goes through `optkit quantize`, `inspect`, `verify`, `eval`, `generate`, the server and
the compatibility matrix, and the runtime reads its config.json as the family says."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from optkit.errors import OptkitError
from optkit.families import family_for, model_types, registered_family
from tests.families.toy_family import MODEL_TYPE, TOY_LLAMA, ToyLlamaConfig, ToyLlamaForCausalLM
from tests.models.paged import run_paged, whole_prefills
from tests.tiny_families import TINY

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def toy_family():
    with registered_family(TOY_LLAMA):
        yield TOY_LLAMA
    assert MODEL_TYPE not in model_types()


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory, draft_dir, toy_family):
    """A tiny random toyllama with the reference tokenizer, saved by its own transformers classes."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("toy") / MODEL_TYPE
    ToyLlamaForCausalLM(ToyLlamaConfig(**TINY)).save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(draft_dir / file, out / file)
    return out


@pytest.fixture(scope="module")
def toy_artifact(toy_model, tmp_path_factory):
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    out = tmp_path_factory.mktemp("toy-artifacts") / "rtn-w8"
    quantize_model(toy_model, out, QuantizeOptions(method="rtn", weights=WeightScheme(bits=8, group_size=64)))
    return out


def test_the_runtime_computes_what_transformers_does_for_the_family(toy_model):
    from optkit.models.loader import load_runtime_model

    reference = ToyLlamaForCausalLM.from_pretrained(toy_model).eval()
    sequences = [list(range(3, 40)), list(range(100, 117))]
    got = run_paged(load_runtime_model(toy_model), sequences, whole_prefills([len(s) for s in sequences]), 16)
    with torch.no_grad():
        want = [reference(torch.tensor([s])).logits[0] for s in sequences]
    assert max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) < 1e-4


def test_quantize_inspect_verify_eval_and_generate(toy_model, run_cli, tmp_path):
    artifact = tmp_path / "toy-w8"
    code, _, err = run_cli("quantize", toy_model, "--method", "rtn", "--bits", "8", "--out", artifact)
    assert code == 0, err
    assert json.loads((artifact / "config.json").read_text())["model_type"] == MODEL_TYPE
    code, out, err = run_cli("inspect", artifact)
    assert code == 0 and MODEL_TYPE in out and "vLLM has no model for toyllama" in out, err
    code, out, err = run_cli("verify", artifact)
    assert code == 0, out + err
    gate = ("--max-windows", "4", "--seq-len", "64", "--max-kld", "0.01")
    code, out, err = run_cli("eval", artifact, "--baseline", toy_model, *gate)  # through the toy's own classes
    assert code == 0, out + err
    code, out, err = run_cli("generate", artifact, PROMPT, "--max-tokens", "6", "--json")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 6


def test_the_server_answers_with_what_generate_gives(toy_artifact, run_cli):
    from starlette.testclient import TestClient

    from optkit.runtime.async_engine import AsyncEngine
    from optkit.runtime.engine_args import EngineConfig
    from optkit.server.app import build_app

    code, out, err = run_cli("generate", toy_artifact, PROMPT, "--max-tokens", "6", "--json")
    assert code == 0, err
    engine = AsyncEngine.start(toy_artifact, EngineConfig(), "toy")
    with TestClient(build_app(engine, None, shutdown_engine=True)) as client:
        response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == json.loads(out)["text"]


def test_the_matrix_and_vllm_spec_ask_the_family(toy_artifact):
    from optkit.compat.matrix import OPTKIT, VLLM, expected_status, kind_from_quant_config, where_it_loads
    from optkit.compat.vllm_spec import check_vllm_spec
    from optkit.modeldir import read_config, read_tensors

    config = read_config(toy_artifact)
    kind = kind_from_quant_config(config["quantization_config"])
    rows = dict(where_it_loads(kind, model_type=MODEL_TYPE))
    assert rows[OPTKIT] == "loads" and rows[VLLM] == "no (vLLM has no model for toyllama: its family names none)"
    assert expected_status(kind, VLLM, model_type="llama") == "by spec"  # a family vLLM runs
    problems = check_vllm_spec(config, read_tensors(toy_artifact), {})
    assert problems == ["vLLM has no model for model_type 'toyllama': its family names none"]


def test_the_gguf_writer_asks_the_family(toy_model, run_cli, tmp_path):
    from optkit.quant.formats.gguf_metadata import architecture

    assert architecture({"model_type": MODEL_TYPE}) == "llama"
    out = tmp_path / "toy-q8.gguf"
    code, _, err = run_cli(
        "quantize", toy_model, "--method", "rtn", "--bits", "8", "--group-size", "32", "--format", "gguf", "--out", out
    )
    assert code == 0, err
    code, out_text, err = run_cli("verify", out)
    assert code == 0, out_text + err


def test_config_json_reads_with_the_family_defaults_or_says_what_is_missing(toy_family):
    from optkit.models.config import ModelConfig

    config = {"model_type": MODEL_TYPE, **{k: v for k, v in TINY.items() if k != "max_position_embeddings"}}
    assert ModelConfig.from_hf(config).max_position_embeddings == 512  # the family's default
    bare = replace(TOY_LLAMA, name="toy-bare", model_types=("toyllama-bare",), types={})
    with registered_family(bare):
        assert family_for("toyllama-bare") is bare
        with pytest.raises(OptkitError, match="lacks max_position_embeddings and family toy-bare gives"):
            ModelConfig.from_hf({**config, "model_type": "toyllama-bare"})
        plain = ModelConfig.from_hf({**config, "model_type": "toyllama-bare", "max_position_embeddings": 64})
        assert plain.max_position_embeddings == 64 and not plain.qkv_bias
