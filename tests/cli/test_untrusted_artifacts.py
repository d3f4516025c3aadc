"""An artifact comes from someone else: what its manifest names stays inside it, `optkit verify`
tells nothing about files outside it, and a broken optkit.json is one line with exit 2."""

import hashlib
import json
import os
import shutil
import stat

import pytest

from optkit.manifest import write_manifest
from tests.cli.test_bad_input import assert_user_error


@pytest.fixture
def artifact(tmp_path, draft_dir):
    """A valid optkit artifact (the draft model's files with their optkit.json), beside a secret."""
    path = tmp_path / "artifact"
    shutil.copytree(draft_dir, path)
    write_manifest(path, {})
    (tmp_path / "secret").write_text("not for the artifact's author")
    return path


def list_files(artifact, **entries):
    manifest = json.loads((artifact / "optkit.json").read_text())
    manifest["files"].update(entries)
    (artifact / "optkit.json").write_text(json.dumps(manifest))


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_fixture_verifies(run_cli, artifact):
    assert run_cli("verify", artifact)[0] == 0


@pytest.mark.parametrize("name", ["../secret", "../../etc/hostname", "/etc/hostname", "sub/../../secret", ""])
def test_a_manifest_name_that_leaves_the_artifact_is_refused(run_cli, artifact, name):
    list_files(artifact, **{name: "0" * 64})
    assert_user_error(run_cli("verify", artifact), "leads outside the artifact", "optkit.json")
    assert_user_error(run_cli("generate", artifact, "x", "--max-tokens", "1"), "leads outside the artifact")


def test_verify_is_no_oracle_for_files_outside(run_cli, tmp_path, artifact):
    """The answer is the same whether the outside file exists with the listed digest or not."""
    list_files(artifact, **{"../secret": sha256(tmp_path / "secret")})
    matching = run_cli("verify", artifact, "--json")
    manifest = json.loads((artifact / "optkit.json").read_text())
    manifest["files"]["../absent"] = manifest["files"].pop("../secret")
    (artifact / "optkit.json").write_text(json.dumps(manifest))
    absent = run_cli("verify", artifact, "--json")
    assert matching[0] == absent[0] == 2 and matching[1] == absent[1] == ""
    assert matching[2].replace("secret", "absent") == absent[2]


@pytest.mark.parametrize("target", ["../secret", "ABSOLUTE", "sub/../../secret", "/dev/null", "/nonexistent"])
@pytest.mark.parametrize("listed", [True, False])
def test_a_symlink_that_leaves_the_artifact_is_refused(run_cli, tmp_path, artifact, target, listed):
    target = str(tmp_path / "secret") if target == "ABSOLUTE" else target
    (artifact / "sub").mkdir()
    (artifact / "tokens.safetensors.txt").symlink_to(target)
    if listed:
        list_files(artifact, **{"tokens.safetensors.txt": sha256(tmp_path / "secret")})
    assert_user_error(run_cli("verify", artifact), "tokens.safetensors.txt", "leads outside the artifact")


def test_a_linked_directory_that_leaves_the_artifact_is_refused(run_cli, tmp_path, artifact):
    (artifact / "up").symlink_to("..")
    assert_user_error(run_cli("verify", artifact), "up", "leads outside the artifact")
    list_files(artifact, **{"up/secret": sha256(tmp_path / "secret")})
    assert_user_error(run_cli("generate", artifact, "x", "--max-tokens", "1"), "up/secret", "leads outside")


def test_symlinks_that_stay_inside_are_files_like_any_other(run_cli, artifact):
    (artifact / "sub").mkdir()
    (artifact / "sub" / "alias.json").symlink_to("../config.json")
    (artifact / "same").symlink_to("sub")
    code, out, _ = run_cli("verify", artifact, "--json")
    assert code == 1 and json.loads(out)["problems"] == ["sub/alias.json: not listed in optkit.json"]
    list_files(artifact, **{"sub/alias.json": sha256(artifact / "config.json")})
    assert run_cli("verify", artifact)[0] == 0


@pytest.mark.parametrize("listed", [True, False])
def test_a_fifo_is_refused_without_blocking(run_cli, artifact, listed):
    os.mkfifo(artifact / "pipe")
    if listed:
        list_files(artifact, pipe="0" * 64)
    assert_user_error(run_cli("verify", artifact), "pipe", "not a regular file")


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device file needs root")
def test_a_device_file_is_refused(run_cli, artifact):
    try:
        os.mknod(artifact / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("no permission to create a device file here")
    list_files(artifact, null="0" * 64)
    assert_user_error(run_cli("verify", artifact), "null", "not a regular file")
    assert_user_error(run_cli("generate", artifact, "x", "--max-tokens", "1"), "null", "not a regular file")


@pytest.mark.parametrize("command", [("verify",), ("generate", "x", "--max-tokens", "1"), ("inspect",)])
@pytest.mark.parametrize("content", ['{"files": ', "\xff\xfe", '{"files": ["config.json"]}', "[]"])
def test_an_optkit_json_that_is_not_a_manifest_is_one_line(run_cli, artifact, command, content):
    (artifact / "optkit.json").write_bytes(content.encode("latin-1"))
    assert_user_error(run_cli(command[0], artifact, *command[1:]), str(artifact / "optkit.json"), "re-create")


def _inspectable(artifact, **fields):
    """The fixture's manifest with the fields `optkit inspect` shows, and `fields` over them."""
    manifest = json.loads((artifact / "optkit.json").read_text())
    manifest.update(method="rtn", format="compressed-tensors", options={}, calibration={"name": "c"})
    manifest.update(ignored_layers=[], base_model={"path": "b", "sha256": "0" * 64}, versions={}, created="now")
    manifest.update(wall_time_s=1.0, layers=[], **fields)
    (artifact / "optkit.json").write_text(json.dumps(manifest))


def test_a_manifest_beside_an_unquantized_config_is_one_line_for_inspect(run_cli, artifact):
    """optkit.json says artifact, config.json has no quantization_config (was a KeyError, exit 3)."""
    _inspectable(artifact)
    assert_user_error(run_cli("inspect", artifact), "has no quantization_config", "re-create")


def test_inspect_shows_an_unnamed_calibration_as_none(run_cli, artifact, tmp_path, small_dir):
    """A manifest whose calibration has no name (the fuzzer's find: KeyError, exit 3) reads as none."""
    quantized = tmp_path / "w8"
    assert run_cli("quantize", small_dir, "--method", "rtn", "--bits", "8", "--out", quantized)[0] == 0
    manifest = json.loads((quantized / "optkit.json").read_text())
    manifest["calibration"] = {}
    (quantized / "optkit.json").write_text(json.dumps(manifest))
    code, out, err = run_cli("inspect", quantized)
    assert code == 0, err
    cells = [[c.strip() for c in line.split("│") if c.strip()] for line in out.splitlines()]
    assert ["calibration", "none"] in cells, out
