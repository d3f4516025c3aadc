"""`optkit run` with `quantize.format: gguf`: the release is one .gguf gated through llama.cpp."""

import json

import pytest

from optkit.gate.llama_cpp import llama_cpp_available
from optkit.manifest import verify_files
from tests.cli.test_bad_input import assert_user_error
from tests.pipeline.test_run import stage_status, write_recipe

GGUF = {"method": "rtn", "format": "gguf", "weights": {"bits": 8, "group_size": 32, "symmetric": True}}


@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
def test_a_gguf_recipe_releases_the_file_llama_cpp_gated_and_skips_unchanged_stages(run_cli, tmp_path, draft_dir):
    recipe = write_recipe(tmp_path, draft_dir, quantize=GGUF)
    first = run_cli("run", recipe, "--json")
    assert first[0] == 0, first[2]
    assert stage_status(first) == {"quantize": "ran", "gate": "ran", "package": "ran"}
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert "model.gguf" in manifest["files"] and manifest["verdict"] == "released"
    assert manifest["format"] == "gguf" and manifest["gate"]["metrics"]["top1_pct"] > 90
    assert (release / "model.gguf").read_bytes()[:4] == b"GGUF"
    assert not verify_files(release, manifest)  # the file is the one the gate measured
    second = run_cli("run", recipe, "--json")
    assert second[0] == 0 and stage_status(second) == {"quantize": "skipped", "gate": "skipped", "package": "ran"}


def test_a_gguf_recipe_with_a_compile_section_names_it(run_cli, tmp_path, draft_dir):
    recipe = write_recipe(tmp_path, draft_dir, quantize=GGUF, compile={"batch_sizes": [1]})
    assert_user_error(run_cli("run", recipe), "compile", "runs in llama.cpp", "drop the compile section")
    assert not (tmp_path / "release").exists()


def test_a_gguf_recipe_with_gate_repair_names_it(run_cli, tmp_path, draft_dir):
    recipe = write_recipe(tmp_path, draft_dir, quantize=GGUF, gate={"max_kld": 0.05, "repair": {}})
    assert_user_error(run_cli("run", recipe), "gate.repair", "not a gguf file")
    assert not (tmp_path / "release").exists()
