"""`optkit run` with `quantize.format: gguf`: the release is one .gguf gated through llama.cpp."""

import json

import pytest

from optkit.gate.llama_cpp import llama_cpp_available
from optkit.manifest import verify_files
from optkit.quant.mixed_gguf import gguf_manifest
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


def test_a_legacy_gguf_recipe_with_gate_repair_names_it(run_cli, tmp_path, draft_dir):
    """Repair climbs the K-quant ladder: a Q8_0 (legacy block) file has none to climb."""
    recipe = write_recipe(tmp_path, draft_dir, quantize=GGUF, gate={"max_kld": 0.05, "repair": {}})
    assert_user_error(run_cli("run", recipe), "gate.repair", "K-quant ladder", "Q4_K_M")
    assert not (tmp_path / "release").exists()


def test_a_k_mix_recipe_with_gate_repair_is_read(tmp_path, small_dir):
    from optkit.pipeline.recipe import load_recipe

    quantize = {"method": "rtn", "format": "gguf", "gguf": {"type": "Q3_K_M"}}
    recipe, _ = load_recipe(write_recipe(tmp_path, small_dir, quantize=quantize, gate={"max_kld": 0.004, "repair": {}}))
    assert recipe.gate.repair is not None and recipe.quantize.gguf.type == "Q3_K_M"


@pytest.mark.slow
@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
def test_repair_climbs_the_k_quant_ladder_to_a_file_smaller_than_the_uniform_type_that_passes(
    run_cli, tmp_path, small_dir
):
    """small in Q3_K_M misses KLD 0.004 in llama.cpp; repair raises some linears along Q3_K < Q4_K
    < ... and releases a file that passes, smaller than Q4_K_S (every linear in Q4_K), which passes
    too. `inspect` counts the new types, `verify` passes, a rerun skips every stage."""
    gate = {"max_windows": 4, "max_kld": 0.004, "repair": {"max_evaluations": 3, "windows": 4}}
    quantize = {"method": "rtn", "format": "gguf", "gguf": {"type": "Q3_K_M"}}
    recipe = write_recipe(tmp_path, small_dir, quantize=quantize, gate=gate)
    code, out, err = run_cli("run", recipe, "--json")
    assert code == 0, err
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert manifest["verdict"] == "released" and manifest["gate"]["metrics"]["kld_mean"] <= 0.004
    steps = manifest["repair"]["steps"]
    assert not steps[0]["passed"] and steps[0]["kld_mean"] > 0.004 and manifest["gate"]["engine"]["name"] == "llama.cpp"
    raised = manifest["precision_overrides"]
    assert raised and all(value["gguf_type"] in ("Q4_K", "Q5_K", "Q6_K", "Q8_0") for value in raised.values())
    assert not verify_files(release, manifest) and run_cli("verify", release / "model.gguf")[0] == 0
    types = {
        row["type"]: row["tensors"]
        for row in json.loads(run_cli("inspect", release / "model.gguf", "--json")[1])["types"]
    }
    layers = {layer["name"]: layer["gguf_type"] for layer in manifest["layers"]}
    assert types["Q3_K"] == sum(t == "Q3_K" for t in layers.values()) < 14  # Q3_K_M holds 14 Q3_K linears
    assert sum(types.values()) == 38 and all(layers[name] == value["gguf_type"] for name, value in raised.items())
    card = (release / "README.md").read_text()
    assert "from a uniform artifact (GGUF Q3_K_M)" in card and all(f"`{name}`" in card for name in raised)

    uniform = tmp_path / "q4_k_s.gguf"
    assert (
        run_cli(
            "quantize", small_dir, "--method", "rtn", "--format", "gguf", "--gguf-type", "Q4_K_S", "--out", uniform
        )[0]
        == 0
    )
    code, out, _ = run_cli(
        "eval", uniform, "--baseline", small_dir, "--max-windows", "4", "--max-kld", "0.004", "--json"
    )
    assert code == 0 and (release / "model.gguf").stat().st_size < uniform.stat().st_size
    again = run_cli("run", recipe, "--json")
    assert again[0] == 0 and stage_status(again) == {
        "quantize": "skipped",
        "gate": "skipped",
        "repair": "skipped",
        "package": "ran",
    }


@pytest.mark.slow
@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
def test_start_smallest_releases_the_q2_k_file_when_it_passes_as_it_is(run_cli, tmp_path, small_dir):
    """`start: smallest` on a K mix quantizes the ladder's smallest type's file type (Q2_K) and, when
    that passes, releases it with the one step recorded in the file's manifest and the release's."""
    gate = {"max_windows": 4, "max_kld": 0.05, "repair": {"start": "smallest", "windows": 4, "max_evaluations": 2}}
    quantize = {"method": "rtn", "format": "gguf", "gguf": {"type": "Q3_K_M"}}
    code, _, err = run_cli("run", write_recipe(tmp_path, small_dir, quantize=quantize, gate=gate), "--json")
    assert code == 0, err
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert manifest["options"]["gguf"] == {"type": "Q2_K"} and manifest["repair"]["result"] == "passed without repair"
    assert gguf_manifest(release / "model.gguf")["repair"] == manifest["repair"]
    assert run_cli("verify", release)[0] == 0
