"""The compile cache is this machine's own: nothing from a model directory is unpickled.

The malicious directory below is what releases used to carry (compile/compile.json naming a
compile/KEY.bin of torch.compile cache artifacts, KEY = torch version + device name), with a .bin
whose one inductor artifact is a pickle that creates a marker file when unpickled.
"""

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest

from optkit.errors import OptkitError
from optkit.manifest import write_manifest
from optkit.runtime.compile_cache import cache_key, cache_path, model_id
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams


class _CreateFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))  # runs at unpickling


def torch_cache_payload(marker) -> bytes:
    """Bytes in torch.compiler.save_cache_artifacts' format (torch/compiler/_cache.py): one
    "inductor" artifact whose content is the pickle. load_cache_artifacts -> populate_caches ->
    InductorCacheArtifact.populate_cache -> FxGraphCache._emit_triton_bundle -> pickle.loads."""
    from torch.utils._appending_byte_serializer import BytesWriter

    writer = BytesWriter()
    writer.write_uint64(1)  # the serializer's encoding version
    writer.write_str("inductor")
    writer.write_uint64(1)  # one artifact of that type
    writer.write_str("fmarkerpayload")
    writer.write_bytes(pickle.dumps(_CreateFile(marker)))
    return writer.to_bytes()


@pytest.fixture
def local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # were anything to reach it
    return tmp_path / "cache" / "compile"


@pytest.fixture
def evil_dir(tmp_path, draft_dir):
    """The draft model plus a forged compile/ that fires `marker` when torch loads it."""
    evil = tmp_path / "evil"
    shutil.copytree(draft_dir, evil)
    (evil / "compile").mkdir()
    key = cache_key("cpu")
    (evil / "compile" / f"{key}.bin").write_bytes(torch_cache_payload(tmp_path / "marker"))
    record = {"key": key, "artifacts": f"{key}.bin", "torch_compile": False, "batch_sizes": [1]}
    (evil / "compile" / "compile.json").write_text(json.dumps(record))
    return evil


def test_the_payload_fires_when_torch_loads_it(tmp_path, evil_dir):
    """Positive control: fed straight to torch.compiler.load_cache_artifacts (in a fresh process,
    with its own inductor cache), the forged .bin runs its code."""
    marker = tmp_path / "marker"
    script = textwrap.dedent(f"""
        import pathlib, torch
        data = pathlib.Path({str(next((evil_dir / "compile").glob("*.bin")))!r}).read_bytes()
        try:
            torch.compiler.load_cache_artifacts(data)
        except Exception:
            pass  # after unpickling, torch finds no graph in what it got; the code has run by then
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    assert marker.exists()


def test_a_shipped_compile_dir_is_ignored_and_never_unpickled(tmp_path, evil_dir, local_cache, caplog):
    with caplog.at_level(logging.WARNING, logger="optkit.runtime.compile_cache"):
        engine = LLMEngine(evil_dir, EngineConfig())
    assert not (tmp_path / "marker").exists()
    assert "compile cache" not in engine.cuda_graphs_note
    [warning] = [r.getMessage() for r in caplog.records if r.name == "optkit.runtime.compile_cache"]
    assert f"ignoring {evil_dir / 'compile'}" in warning and "optkit compile" in warning


def test_generate_on_a_forged_release_runs_nothing(run_cli, tmp_path, evil_dir, local_cache, caplog):
    code, out, err = run_cli("generate", evil_dir, "def f():", "--max-tokens", "3", "--json")
    assert code == 0, err
    assert not (tmp_path / "marker").exists()
    assert any("ignoring" in r.getMessage() for r in caplog.records)


def test_compile_warms_the_local_cache_and_the_engine_finds_it_there(run_cli, tmp_path, draft_dir, local_cache):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    code, out, err = run_cli("compile", model, "--batch-sizes", "1,2", "--device", "cpu", "--json")
    assert code == 0, err
    entry = cache_path(model, "cpu")
    assert json.loads(out)["path"] == str(entry) and entry.parent.parent == local_cache
    record = json.loads((entry / "compile.json").read_text())
    assert record["batch_sizes"] == [1, 2] and record["torch_compile"] is False and record["device_name"] == "cpu"
    assert sorted(p.name for p in model.iterdir()) == sorted(p.name for p in draft_dir.iterdir())  # nothing added
    engine = LLMEngine(model, EngineConfig())
    assert f"compile cache {entry}" in engine.cuda_graphs_note
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]) == 3


def test_the_cache_entry_follows_the_model_content(tmp_path, draft_dir, local_cache):
    """Changed weights or config -> another entry; an artifact's id comes from its optkit.json and
    equals that of a plain copy of the same files."""
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    plain = model_id(model)
    write_manifest(model, {})
    assert model_id(model) == plain
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    write_manifest(model, {})
    assert model_id(model) != plain
    assert cache_path(model, "cpu").parent.name == model_id(model)


def test_a_compile_cache_inside_the_model_dir_is_refused(tmp_path, draft_dir):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    with pytest.raises(OptkitError, match="inside the model directory"):
        LLMEngine(model, EngineConfig(compile_dir=str(model / "compile")))


def test_compile_out_is_gone_with_a_line_saying_why(run_cli, tmp_path, draft_dir, local_cache):
    code, _, err = run_cli("compile", draft_dir, "--out", tmp_path, "--device", "cpu")
    assert code == 2 and "--out is gone" in err and "Traceback" not in err
    assert not local_cache.exists()


def test_torch_compile_needs_cuda(run_cli, draft_dir, local_cache):
    code, _, err = run_cli("compile", draft_dir, "--device", "cpu", "--torch-compile")
    assert code == 2 and "--device cuda" in err
