"""`optkit verify RELEASE` checks every release kind against its optkit.json: a release of a .gguf
(no config.json) as much as one of a safetensors artifact, and `verify RELEASE/model.gguf` the
file's sha256 against the release's manifest."""

import json
from pathlib import Path

import pytest
import yaml

from optkit.gate.llama_cpp import llama_cpp_available

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def assert_mismatch(result, name: str) -> None:
    code, out, err = result
    assert code == 1, (code, out, err)
    assert name in out and "Traceback" not in err


def gguf_release(directory: Path) -> Path:
    """What `optkit run` packages for a .gguf recipe: the file, a card, the gate's record and
    optkit.json listing them; no config.json."""
    from optkit.manifest import write_manifest

    directory.mkdir()
    (directory / "model.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    (directory / "README.md").write_text("# release\n")
    (directory / "gate.json").write_text(json.dumps({"verdict": "pass"}) + "\n")
    write_manifest(directory, {"format": "gguf", "verdict": "released"})
    return directory


def test_a_gguf_release_directory_verifies_against_its_manifest(run_cli, tmp_path):
    release = gguf_release(tmp_path / "release")
    code, out, err = run_cli("verify", release)
    assert code == 0, (out, err)
    assert "3 files match optkit.json" in out
    flip_byte(release / "model.gguf")
    assert_mismatch(run_cli("verify", release), "model.gguf")


def test_a_gguf_in_a_release_is_checked_against_the_release_manifest(run_cli, tmp_path):
    release = gguf_release(tmp_path / "release")
    flip_byte(release / "model.gguf")
    result = run_cli("verify", release / "model.gguf")
    assert_mismatch(result, "model.gguf")
    assert "sha256" in result[1]
    code, out, _ = run_cli("verify", release / "model.gguf", "--json")
    assert code == 1 and json.loads(out)["ok"] is False


def test_load_transformers_on_a_gguf_release_names_the_file_loader(run_cli, tmp_path):
    from tests.cli.test_bad_input import assert_user_error

    release = gguf_release(tmp_path / "release")
    assert_user_error(run_cli("verify", release, "--load", "transformers"), "no config.json", "--load llama.cpp")


def shrunk(recipe: Path) -> list[str]:
    """--set overrides that make `recipe` run in seconds on `draft` (templates included: their
    MODEL_DIR and data files are replaced by the bundled ones)."""
    data = yaml.safe_load(recipe.read_text())
    # a K mix's super-blocks span 256 columns: small's rows (256, 768) hold them, draft's (128) do not
    k_mix = "_K" in str((data["quantize"].get("gguf") or {}).get("type", ""))
    sets = [
        "model=small" if k_mix else "model=draft",
        "quantize.calibration.calib=calib",
        "quantize.calibration.num_samples=8",
        "quantize.calibration.seq_len=64",
        "gate.eval_set=heldout",
        "gate.seq_len=64",
        "gate.max_windows=4",
        "gate.task=null",
        "gate.min_recovery=null",
    ]
    if "awq" in data["quantize"]:
        sets += ["quantize.awq.grid=2", "quantize.awq.clip_steps=2", "quantize.awq.search_samples=4"]
    if "smoothquant" in data["quantize"]:
        sets += ["quantize.smoothquant.alpha_grid=2", "quantize.smoothquant.search_samples=4"]
    if "compile" in data:
        sets += ["compile.batch_sizes=[1]", "compile.device=cpu"]
    return [part for s in sets for part in ("--set", s)]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_makes_a_release_that_verify_checks(run_cli, tmp_path, monkeypatch, recipe):
    """Whatever the verdict, the release `optkit run` writes passes `optkit verify DIR`, and fails it
    (exit 1, naming the file) once one byte of its weights changes."""
    if yaml.safe_load(recipe.read_text())["quantize"].get("format") == "gguf" and not llama_cpp_available():
        pytest.skip("the gguf recipe is gated through llama.cpp: pip install 'optkit[gguf]'")
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    release = tmp_path / "release"
    code, out, err = run_cli("run", recipe, "--out", release, *shrunk(recipe), "--json")
    assert code in (0, 1), (code, err)
    code, out, err = run_cli("verify", release)
    assert code == 0, (out, err)
    manifest = json.loads((release / "optkit.json").read_text())
    weights = max(manifest["files"], key=lambda name: (release / name).stat().st_size)
    assert weights in ("model.safetensors", "model.gguf")
    flip_byte(release / weights)
    assert_mismatch(run_cli("verify", release), weights)
    if weights == "model.gguf":
        assert_mismatch(run_cli("verify", release / weights), weights)
