"""Which weight files a model directory loads: those its optkit.json lists (an unlisted one in an
artifact is refused), or, for a plain checkpoint, `model.safetensors` or the shards its index
names, as transformers picks them; a stray file never overrides a tensor, and no file is read
through a symlink that leads out of the directory."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from optkit.errors import OptkitError
from tests.cli.test_bad_input import assert_user_error

NORM = "model.norm.weight"


def norm_of(model_dir) -> torch.Tensor:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return f.get_tensor(NORM)


def replaced_norm(path, like: torch.Tensor):
    """A safetensors file holding only a replaced final norm."""
    save_file({NORM: torch.full_like(like, 7.0)}, path)
    return path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("artifact") / "draft-w4"
    quantize_model(draft_dir, out, QuantizeOptions())
    return out


@pytest.fixture
def tampered(artifact, tmp_path, request):
    """The artifact with an extra `zz.safetensors` that no manifest lists: a symlink to a file
    outside it, or a file in it; sorted after model.safetensors, so read last, it would win."""
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    if request.param == "symlink":
        (copy / "zz.safetensors").symlink_to(replaced_norm(tmp_path / "outside.safetensors", norm_of(artifact)))
    else:
        replaced_norm(copy / "zz.safetensors", norm_of(artifact))
    return copy


@pytest.fixture
def plain_copy(draft_dir, tmp_path):
    copy = tmp_path / "plain"
    shutil.copytree(draft_dir, copy)
    return copy


@pytest.mark.parametrize("tampered", ["symlink", "file"], indirect=True)
def test_an_unlisted_weight_file_in_an_artifact_is_refused_by_every_loader(tampered):
    from optkit.modeldir import TensorReader
    from optkit.models.loader import load_runtime_model
    from optkit.quant.formats.load import load_model

    for load in (load_runtime_model, load_model, TensorReader):
        with pytest.raises(OptkitError, match="zz.safetensors is not listed in optkit.json"):
            load(tampered)


@pytest.mark.parametrize("tampered", ["symlink"], indirect=True)
def test_generate_refuses_an_artifact_with_an_unlisted_weight_file(run_cli, tampered):
    result = run_cli("generate", tampered, "def f():", "--max-tokens", "2")
    assert_user_error(result, "zz.safetensors", "not listed in optkit.json")


@pytest.mark.parametrize("tampered", ["symlink"], indirect=True)
def test_transformers_is_not_asked_to_load_an_artifact_with_an_unlisted_weight_file(tampered):
    from optkit.compat.transformers_load import load_transformers

    with pytest.raises(OptkitError, match="zz.safetensors is not listed"):
        load_transformers(tampered)


@pytest.mark.parametrize("tampered", ["file"], indirect=True)
def test_verify_names_the_unlisted_weight_file(run_cli, tampered):
    code, out, err = run_cli("verify", tampered)
    assert code == 1 and "zz.safetensors: not listed in optkit.json" in out, (out, err)


def test_a_plain_checkpoint_loads_model_safetensors_and_no_stray_file(plain_copy, draft_dir):
    from optkit.modeldir import TensorReader, read_tensors

    replaced_norm(plain_copy / "zz.safetensors", norm_of(draft_dir))
    assert torch.equal(TensorReader(plain_copy).get(NORM), norm_of(draft_dir))
    assert torch.equal(read_tensors(plain_copy)[NORM], norm_of(draft_dir))


def shard(plain_copy) -> dict[str, str]:
    """Split model.safetensors into two shards and an index, as save_pretrained shards."""
    with safe_open(plain_copy / "model.safetensors", framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    (plain_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for file, keys in (
        ("model-00001-of-00002.safetensors", names[:half]),
        ("model-00002-of-00002.safetensors", names[half:]),
    ):
        save_file({k: tensors[k] for k in keys}, plain_copy / file)
        weight_map.update(dict.fromkeys(keys, file))
    (plain_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_a_sharded_checkpoint_loads_the_shards_its_index_names(plain_copy, draft_dir):
    from optkit.modeldir import TensorReader

    weight_map = shard(plain_copy)
    replaced_norm(plain_copy / "model-00003-of-00002.safetensors", norm_of(draft_dir))
    reader = TensorReader(plain_copy)
    assert sorted(reader.keys()) == sorted(weight_map)
    assert torch.equal(reader.get(NORM), norm_of(draft_dir))


def test_a_tensor_in_two_shards_is_refused(plain_copy, draft_dir):
    from optkit.modeldir import TensorReader, verify_weights

    for file in set(shard(plain_copy).values()):  # the final norm in both shards: neither may win
        with safe_open(plain_copy / file, framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        save_file({**tensors, NORM: torch.full_like(norm_of(draft_dir), 7.0)}, plain_copy / file)
    for load in (TensorReader, verify_weights):  # every loader and quantize check with the latter first
        with pytest.raises(OptkitError, match=f"tensor {NORM} is in both"):
            load(plain_copy)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_weight_file_linked_from_outside_a_plain_checkpoint_is_refused(plain_copy, tmp_path, layout):
    from optkit.models.loader import load_runtime_model

    if layout == "sharded":
        shard(plain_copy)
        name = "model-00001-of-00002.safetensors"
    else:
        name = "model.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(plain_copy / name, outside)
    (plain_copy / name).symlink_to(outside)
    with pytest.raises(OptkitError, match="leads outside"):
        load_runtime_model(plain_copy)


def test_a_link_inside_a_plain_checkpoint_still_loads(plain_copy, draft_dir):
    from optkit.modeldir import TensorReader

    (plain_copy / "weights").mkdir()
    shutil.move(plain_copy / "model.safetensors", plain_copy / "weights" / "model.safetensors")
    (plain_copy / "model.safetensors").symlink_to("weights/model.safetensors")
    assert torch.equal(TensorReader(plain_copy).get(NORM), norm_of(draft_dir))
