"""The EAGLE head's on-disk contract: a head saved for a model loads for it, and a head for another
model, with missing, extra or misshapen tensors, or with NaNs, is refused in one line."""

import json

import pytest
import torch

from optkit.errors import OptkitError
from optkit.modeldir import read_config
from optkit.models.config import ModelConfig
from optkit.runtime.eagle_layer import layer_shapes
from optkit.speculative.eagle_head import head_config_for, load_head, save_head, target_digest
from tests.runtime.eagle_heads import head_tensors


@pytest.fixture(scope="module")
def shapes(small_dir):
    target = ModelConfig.from_hf(read_config(small_dir))
    return lambda config: layer_shapes(target, config)


def test_a_saved_head_loads_for_its_target(tmp_path, small_dir, shapes):
    tensors = head_tensors(small_dir)
    save_head(tmp_path / "head", head_config_for(small_dir), tensors)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert (config["format"], config["kind"], config["feature_layers"]) == ("optkit-eagle", "eagle1", [-1])
    assert config["target_sha256"] == target_digest(small_dir)
    head = load_head(tmp_path / "head", small_dir, shapes)
    assert torch.equal(head.fc_weight, tensors["fc.weight"])
    assert set(head.layer) == {name.removeprefix("layers.0.") for name in tensors if name != "fc.weight"}
    assert "input_layernorm.weight" not in head.layer


def test_a_head_for_another_model_is_refused(tmp_path, small_dir, draft_dir):
    save_head(tmp_path / "head", head_config_for(small_dir), head_tensors(small_dir))
    with pytest.raises(OptkitError, match="trained for another model") as error:
        load_head(tmp_path / "head", draft_dir)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop("layers.0.mlp.down_proj.weight"), "lacks layers.0.mlp.down_proj.weight"),
        (lambda t: t.update({"layers.0.mlp.extra.weight": torch.zeros(2)}), "has layers.0.mlp.extra.weight"),
        (lambda t: t.update({"layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}), r"up_proj.weight is \[3, 3\]"),
        (lambda t: t["layers.0.self_attn.q_proj.weight"].view(-1).__setitem__(7, float("nan")), "NaN"),
        (lambda t: t.update({"fc.weight": torch.zeros(4, 4)}), r"fc.weight is \[4, 4\]"),
        (lambda t: t.update({"layers.0.input_layernorm.weight": torch.ones(256)}), "no input_layernorm"),
    ],
)
def test_damaged_heads_are_refused_in_one_line(tmp_path, small_dir, shapes, damage, message):
    from safetensors.torch import save_file

    save_head(tmp_path / "head", head_config_for(small_dir), head_tensors(small_dir))
    tensors = head_tensors(small_dir)
    damage(tensors)
    save_file(tensors, tmp_path / "head" / "model.safetensors")  # behind save_head's back
    with pytest.raises(OptkitError, match=message) as error:
        load_head(tmp_path / "head", small_dir, shapes)
    assert "\n" not in str(error.value)


def test_a_config_of_another_format_is_refused(tmp_path, small_dir):
    save_head(tmp_path / "head", head_config_for(small_dir), head_tensors(small_dir))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, "feature_layers": [2, 5, 9]}))
    with pytest.raises(OptkitError, match="an EAGLE-1 head.s feature is the last layer.s"):
        load_head(tmp_path / "head", small_dir)
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, "format": "medusa"}))
    with pytest.raises(OptkitError, match="not an optkit EAGLE head"):
        load_head(tmp_path / "head", small_dir)
