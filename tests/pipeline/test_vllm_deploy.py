"""A recipe's `deploy:` writes the release's vllm.yaml (pipeline/vllm_deploy.py): derived from the
artifact, never anything that loads code, and `optkit verify` holds it to that."""

import json

import pytest
import yaml

from optkit.artifacts import file_sha256
from optkit.errors import OptkitError
from optkit.pipeline.vllm_deploy import CODE_LOADING, DeployOptions, vllm_config
from tests.pipeline.test_run import write_recipe

W4 = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}
CONFIG = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 512}


def test_the_config_follows_the_artifact_and_loads_no_code():
    plain = vllm_config(DeployOptions(tensor_parallel_size=2), CONFIG, "m")
    assert plain["dtype"] == "auto" and plain["max-model-len"] == 512 and plain["tensor-parallel-size"] == 2
    quantized = vllm_config(DeployOptions(max_model_len=256), {**CONFIG, "quantization_config": W4}, "m")
    assert quantized["dtype"] == "bfloat16" and quantized["max-model-len"] == 256
    assert not set(plain) & set(CODE_LOADING) and "quantization" not in quantized  # vLLM reads config.json's


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"tensor_parallel_size": 3}, "does not divide the model's 8 attention heads"),
        ({"tensor_parallel_size": 8}, "does not split or replicate"),
        ({"tensor_parallel_size": 4}, None),  # 2 KV heads replicated on 4 ranks
        ({"pipeline_parallel_size": 5}, "over the model's 4 layers"),
        ({"max_model_len": 1024}, "over the model's context of 512"),
    ],
)
def test_a_split_or_context_the_model_cannot_take_is_one_line(options, says):
    config = {**CONFIG, "num_key_value_heads": 2}
    if options.get("tensor_parallel_size") == 8:
        config["num_attention_heads"] = 16
        config["num_key_value_heads"] = 6
    if says is None:
        vllm_config(DeployOptions(**options), config, "m")
        return
    with pytest.raises(OptkitError, match=says):
        vllm_config(DeployOptions(**options), config, "m")


def rewrite(release, name: str, text: str) -> None:
    """Change a release file and its digest in optkit.json, as someone crafting a release would."""
    (release / name).write_text(text)
    manifest = json.loads((release / "optkit.json").read_text())
    manifest["files"][name] = file_sha256(release / name)
    (release / "optkit.json").write_text(json.dumps(manifest))


def test_a_release_carries_its_vllm_config_and_verify_holds_it_to_the_artifact(run_cli, tmp_path, draft_dir):
    deploy = {"engine": "vllm", "tensor_parallel_size": 2, "max_model_len": 64, "kv_cache_dtype": "fp8"}
    recipe = write_recipe(tmp_path, draft_dir, deploy=deploy, quantize={"method": "rtn", "weights": {"bits": 4}})
    code, _, err = run_cli("run", recipe, "--json")
    assert code == 0, err
    release = tmp_path / "release"
    values = yaml.safe_load((release / "vllm.yaml").read_text())
    assert values["dtype"] == "bfloat16" and values["tensor-parallel-size"] == 2 and values["max-model-len"] == 64
    assert values["kv-cache-dtype"] == "fp8" and values["served-model-name"] == "release"
    readme = (release / "README.md").read_text()
    assert "--distributed-executor-backend ray" in readme and "ray start --head" in readme
    assert "--dtype bfloat16" in readme  # vLLM-CPU's dtype for weight-only ints
    assert run_cli("verify", release)[0] == 0

    text = (release / "vllm.yaml").read_text()
    rewrite(release, "vllm.yaml", text.replace('"bfloat16"', '"float16"'))
    code, out, _ = run_cli("verify", release, "--json")
    assert code == 1 and "dtype" in json.loads(out)["problems"][0]
    rewrite(release, "vllm.yaml", text + 'speculative-config: {"method": "draft_model", "model": "someone/else"}\n')
    code, out, _ = run_cli("verify", release, "--json")
    assert code == 1 and "speculative-config is not an option optkit writes" in json.loads(out)["problems"][0]
    rewrite(release, "vllm.yaml", text + "trust-remote-code: true\n")
    code, _, err = run_cli("verify", release)
    assert code == 2 and "makes vLLM load code" in err


def test_a_gguf_release_cannot_deploy_on_vllm(run_cli, tmp_path, draft_dir):
    recipe = write_recipe(tmp_path, draft_dir, deploy={"engine": "vllm"}, quantize={"format": "gguf"})
    code, _, err = run_cli("run", recipe)
    assert code == 2 and "drop deploy" in err
