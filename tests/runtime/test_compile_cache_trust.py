"""The compile cache is this machine's own: no recipe or routing config can point it elsewhere, a
cache directory another user could write into is refused, and nothing is unpickled on the CPU.

The payload is tests/runtime/test_compile_cache.py's: torch.compiler.save_cache_artifacts' format
holding one pickle that creates a marker file when unpickled.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from optkit.errors import OptkitError
from optkit.pipeline.recipe import load_recipe
from optkit.routing.config import serve_options
from optkit.runtime.compile_cache import cache_path, load_cache
from optkit.runtime.engine import EngineConfig, LLMEngine
from tests.runtime.test_compile_cache import torch_cache_payload


@pytest.fixture
def local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # were anything to reach it
    return tmp_path / "cache" / "compile"


def forge_entry(model, root, marker):
    """A warm-up entry for `model` on the CPU under `root`, saying torch_compile, with the payload."""
    entry = cache_path(model, "cpu", root)
    entry.mkdir(parents=True)
    (entry / "torch_compile.bin").write_bytes(torch_cache_payload(marker))
    (entry / "compile.json").write_text(json.dumps({"torch_compile": True, "batch_sizes": [1]}))
    return entry


def fires(blob, tmp_path) -> bool:
    """Whether `blob`, fed straight to torch.compiler.load_cache_artifacts in a fresh process (its
    own inductor cache), creates tmp_path/marker."""
    script = textwrap.dedent(f"""
        import pathlib, torch
        try:
            torch.compiler.load_cache_artifacts(pathlib.Path({str(blob)!r}).read_bytes())
        except Exception:
            pass  # torch finds no graph in what it unpickled; the code has run by then
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-control")}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    return (tmp_path / "marker").exists()


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_recipe_naming_the_compile_cache_is_refused_and_its_payload_never_runs(
    run_cli, tmp_path, small_dir, local_cache, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    entry = forge_entry(small_dir, "evil", tmp_path / "marker")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("serve:\n  engine:\n    compile_dir: evil\n")
    code, _, err = run_cli("serve", "small", "--recipe", recipe, "--device", "cpu", "--port", "0")
    line = one_line_error(err)
    assert code == 2 and "engine" in line and "compile_dir" in line and "--compile-dir" in line
    assert not (tmp_path / "marker").exists()
    assert fires(entry / "torch_compile.bin", tmp_path)  # positive control: the same file, fed to torch, runs


def test_a_release_recipe_and_a_routing_config_cannot_name_the_compile_cache(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: small\noutput: out\nserve:\n  engine:\n    compile_dir: /tmp/anywhere\n")
    with pytest.raises(OptkitError, match=r"serve\.engine'.*compile_dir cannot come from a recipe"):
        load_recipe(recipe)
    with pytest.raises(OptkitError, match="compile_dir cannot come from a recipe or routing config"):
        serve_options({"models": {"a": {"path": "small"}}, "engine": {"compile_dir": "/tmp/anywhere"}})


def test_nothing_is_unpickled_before_the_cuda_check(tmp_path, draft_dir, local_cache):
    """An entry of this machine's own cache that asks for torch.compile on the CPU: the engine
    refuses --torch-compile there, and the blob is never read."""
    forge_entry(draft_dir, local_cache, tmp_path / "marker")
    with pytest.raises(OptkitError, match="--torch-compile needs --device cuda"):
        LLMEngine(draft_dir, EngineConfig())
    assert not (tmp_path / "marker").exists()


def test_compile_dir_on_the_command_line_is_created_private_whatever_the_umask(run_cli, tmp_path, draft_dir):
    root = tmp_path / "mine"
    previous = os.umask(0o002)  # a common default: group-writable files
    try:
        code, out, err = run_cli("compile", draft_dir, "--compile-dir", root, "--batch-sizes", "1", "--device", "cpu")
    finally:
        os.umask(previous)
    assert code == 0, err
    entry = cache_path(draft_dir, "cpu", root)
    for path in (root, entry.parent, entry, entry / "compile.json"):
        assert not stat.S_IMODE(path.stat().st_mode) & 0o022, path
    engine = LLMEngine(draft_dir, EngineConfig(compile_dir=str(root)))
    assert f"compile cache {entry}" in engine.cuda_graphs_note


@pytest.mark.parametrize("part", ["root", "model", "key"])
@pytest.mark.parametrize("bits", [stat.S_IWGRP, stat.S_IWOTH])
def test_a_cache_directory_others_may_write_is_refused(run_cli, tmp_path, draft_dir, local_cache, part, bits):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    code, _, err = run_cli("compile", model, "--batch-sizes", "1", "--device", "cpu")
    assert code == 0, err
    entry = cache_path(model, "cpu")
    unsafe = {"root": local_cache, "model": entry.parent, "key": entry}[part]
    unsafe.chmod(stat.S_IMODE(unsafe.stat().st_mode) | bits)
    code, _, err = run_cli("generate", model, "def f():", "--max-tokens", "2", "--device", "cpu")
    line = one_line_error(err)
    assert code == 2 and f"compile cache {unsafe} is writable by" in line and f"chmod go-w {unsafe}" in line
    code, _, err = run_cli("compile", model, "--batch-sizes", "1", "--device", "cpu")  # nor is it written into
    assert code == 2 and f"chmod go-w {unsafe}" in one_line_error(err)


def test_a_torch_blob_others_may_write_is_never_loaded(tmp_path, draft_dir, local_cache):
    entry = forge_entry(draft_dir, local_cache, tmp_path / "marker")
    (entry / "torch_compile.bin").chmod(0o666)
    with pytest.raises(OptkitError, match="compile cache file .*torch_compile.bin is writable by group and others"):
        load_cache(entry, "cuda")  # the CUDA path, where the blob would be loaded
    assert not (tmp_path / "marker").exists()


def test_a_cache_another_user_owns_is_refused(tmp_path, draft_dir, local_cache, monkeypatch):
    forge_entry(draft_dir, local_cache, tmp_path / "marker")
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(local_cache).st_uid + 1)
    with pytest.raises(OptkitError, match=f"compile cache {local_cache} belongs to another user"):
        LLMEngine(draft_dir, EngineConfig())
    assert not (tmp_path / "marker").exists()
