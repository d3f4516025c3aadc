"""Crafted .gguf files (issue #30, sections 3-6): every one gets one line and exit 2 from verify and
eval, never a traceback, a signal, a long run or a large allocation; inspect describes what it can
and refuses the rest the same way; nothing a file holds reaches the terminal as control sequences."""

import hashlib
import json
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from optkit.gate.llama_cpp import llama_cpp_available
from tests.cli import gguf_craft as g

ESC = "\x1b"
ROOT = Path(__file__).resolve().parents[2]
needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")


def _one_line_refusal(code: int, out: str, err: str, path, expected: int = 2) -> None:
    assert code == expected, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert str(path) in lines[0], err
    assert "Traceback" not in out + err and ESC not in out + err


def _timed(run_cli, *args):
    start = time.perf_counter()
    result = run_cli(*args)
    assert time.perf_counter() - start < 5, args
    return result


def _changed(**metadata) -> g.Crafted:
    crafted = g.tiny_llama()
    for key, value in metadata.items():
        key = key.replace("__", ".")
        if value is None:
            del crafted.metadata[key]
        else:
            crafted.metadata[key] = value
    return crafted


def _duplicate_key():
    crafted = g.tiny_llama()
    crafted.extra_metadata.append(("general.architecture", g.text("qwen2")))
    return crafted


def _tensor_dims(dims: list[int]):
    """token_embd.weight's info written with `dims`, whatever their number and size."""
    crafted = g.tiny_llama()
    crafted.tensors[0].dims = tuple(dims)
    name = g.string("token_embd.weight")
    infos = name + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", 0, 0)
    crafted.raw_tensor_infos, crafted.n_tensors = infos, 1
    return crafted


def _bad_utf8_tokens():
    tokens = g.byte_tokens()
    packed = struct.pack("<IIQ", g.ARRAY, g.STRING, len(tokens))
    packed += b"".join(g.string(t) for t in tokens[:-1]) + g.string(b"\xff\xfe")
    return _changed(tokenizer__ggml__tokens=packed)


def _renamed_tensor(name: str):
    crafted = g.tiny_llama()
    crafted.tensors.append(g.Tensor(name, (g.WIDTH,), b"\0" * 4 * g.WIDTH))
    return crafted


# case -> (the file, inspect's exit code: it describes a file whose header parses, whatever its values)
CASES = {
    "duplicate key": (_duplicate_key, 2),
    "general.alignment as u64": (lambda: _changed(general__alignment=g.scalar(g.U64, 32)), 2),
    "65 dimensions": (lambda: _tensor_dims([1] * 65), 2),
    "a dimension of 2^63": (lambda: _tensor_dims([2**63, 1]), 2),
    "invalid UTF-8 in array strings": (_bad_utf8_tokens, 2),
    "the architecture as an array": (lambda: _changed(general__architecture=g.strings(["llama"])), 0),
    "optkit.manifest holding [1] (an array)": (lambda: _changed(optkit__manifest=g.numbers(g.U32, [1])), 2),
    "optkit.manifest holding [1] (JSON)": (lambda: _changed(optkit__manifest=g.text("[1]")), 2),
    "zero heads": (lambda: _changed(llama__attention__head_count=g.scalar(g.U32, 0)), 0),
    "a missing eps": (lambda: _changed(llama__attention__layer_norm_rms_epsilon=None), 0),
    "block_count 0": (lambda: _changed(llama__block_count=g.scalar(g.U32, 0)), 0),
    "block_count 2^40": (lambda: _changed(llama__block_count=g.scalar(g.U64, 2**40)), 0),
    "block_count 2^32-1": (lambda: _changed(llama__block_count=g.scalar(g.U32, 2**32 - 1)), 0),
    "heads that do not divide": (lambda: _changed(llama__attention__head_count_kv=g.scalar(g.U32, 3)), 0),
    "token types shorter than the vocabulary": (
        lambda: _changed(tokenizer__ggml__token_type=g.numbers(g.I32, [1] * 10)),
        0,
    ),
    "a tensor count of 2^40": (lambda: _with(n_tensors=2**40), 2),
    "a metadata count over the bound": (lambda: _with(n_kv=10**6), 2),
    "a metadata count larger than the file": (lambda: _with(n_kv=60_000), 2),
}


def _with(**fields):
    crafted = g.tiny_llama()
    for name, value in fields.items():
        setattr(crafted, name, value)
    return crafted


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_gguf_gets_one_line_and_exit_2(run_cli, tmp_path, case):
    make, inspect_code = CASES[case]
    path = tmp_path / "crafted.gguf"
    make().write(path)
    code, out, err = _timed(run_cli, "verify", path)
    _one_line_refusal(code, out, err, path)
    code, out, err = _timed(run_cli, "verify", path, "--json")
    assert code == 2 and not json.loads(out)["ok"] and "Traceback" not in err
    code, out, err = _timed(run_cli, "inspect", path)
    if inspect_code:
        _one_line_refusal(code, out, err, path)
    else:
        assert code == 0 and "Traceback" not in err and ESC not in out + err, (code, err)
        code, out, err = _timed(run_cli, "inspect", path, "--json")
        assert code == 0 and json.loads(out)["file"] == str(path)
    code, out, err = _timed(run_cli, "eval", path, "--baseline", "small", "--json")
    _one_line_refusal(code, out, err, path)


def test_the_valid_base_of_the_crafted_files_passes_every_check(run_cli, tmp_path):
    """The positive control: each crafted file is refused for the one field it changed."""
    path = tmp_path / "tiny.gguf"
    g.tiny_llama().write(path)
    code, out, err = run_cli("verify", path, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], report
    assert report["llama_cpp"] == ("loaded, logits finite" if llama_cpp_available() else report["llama_cpp"])
    code, out, err = run_cli("inspect", path, "--json")
    assert code == 0 and json.loads(out)["hyperparameters"]["block_count"] == 1


@pytest.mark.parametrize("name", ["[/]", "[bold red]x[/]"])
def test_a_tensor_named_like_rich_markup_is_shown_as_it_is(run_cli, tmp_path, name):
    path = tmp_path / "markup.gguf"
    _renamed_tensor(name).write(path)
    code, out, err = _timed(run_cli, "inspect", path)
    assert code == 0 and name in out and "Traceback" not in err, err
    code, out, err = _timed(run_cli, "verify", path)
    if llama_cpp_available():  # llama.cpp refuses a tensor its graph does not use
        _one_line_refusal(code, out, err, path)
    else:
        assert code == 0 and "Traceback" not in err


HOSTILE = "\x1b]0;owned\x07\x1b[2J\u202eevil\x9b31m"


def test_control_sequences_in_names_and_values_never_reach_the_terminal(run_cli, tmp_path):
    crafted = _changed(general__name=g.text(HOSTILE), general__quantized_by=g.text("\x1b[31mred"))
    crafted.tensors.append(g.Tensor(f"{HOSTILE}.weight", (g.WIDTH,), b"\xff" * 4 * g.WIDTH))  # NaN: verify names it
    path = tmp_path / "escapes.gguf"
    crafted.write(path)
    code, out, err = _timed(run_cli, "inspect", path)
    assert code == 0, err
    for raw in ("\x1b", "\x07", "\u202e", "\x9b"):
        assert raw not in out + err
    assert "\\x1b]0;owned\\x07" in out and "\\u202eevil" in out  # shown escaped, not dropped
    code, out, err = _timed(run_cli, "verify", path)
    assert code == 2 and "\\x1b]0;owned" in err and "NaN" in err, err
    assert ESC not in out + err and "\u202e" not in err
    code, out, _ = _timed(run_cli, "inspect", path, "--json")
    assert json.loads(out)["name"] == HOSTILE and ESC not in out  # JSON escapes it, and keeps it exact


def test_an_architecture_with_control_characters_is_escaped_in_the_error(run_cli, tmp_path):
    path = tmp_path / "arch.gguf"
    _changed(general__architecture=g.text("\x1b[31mllama")).write(path)
    for command in ("verify", "eval"):
        args = (command, path) if command == "verify" else (command, path, "--baseline", "small")
        code, out, err = _timed(run_cli, *args)
        _one_line_refusal(code, out, err, path)
        assert "\\x1b[31mllama" in err


def test_artifact_file_names_are_printed_as_text_not_markup(run_cli, tmp_path):
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": np.zeros(2, dtype=np.float32)}, artifact / "model.safetensors")
    weights = hashlib.sha256((artifact / "model.safetensors").read_bytes()).hexdigest()
    (artifact / "x[").mkdir()  # the name x[/].txt: a file "].txt" in a folder "x["
    (artifact / "x[/].txt").write_text("added")
    (artifact / "y\x1b[31m.txt").write_text("added")
    (artifact / "optkit.json").write_text(json.dumps({"files": {"model.safetensors": weights, "x[/].txt": "0" * 64}}))
    code, out, err = run_cli("verify", artifact)
    assert code == 1 and "Traceback" not in err and "MarkupError" not in err, err
    assert "x[/].txt: sha256 differs" in out and "y\\x1b[31m.txt" in out and ESC not in out + err


def _bounded_run(args: list[str], limit_bytes: int = 1 << 30) -> subprocess.CompletedProcess:
    """`optkit ARGS` in a child whose address space is capped: a large allocation is a MemoryError there."""
    code = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, {limit_bytes}))
        sys.argv = ["optkit", *{args!r}]
        from optkit.cli.main import main
        main()
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_block_count_2_to_the_40_allocates_nothing_from_it(tmp_path):
    path = tmp_path / "layers.gguf"
    _changed(llama__block_count=g.scalar(g.U64, 2**40)).write(path)
    start = time.perf_counter()
    done = _bounded_run(["verify", str(path)])
    assert time.perf_counter() - start < 5 + _python_start()
    _one_line_refusal(done.returncode, done.stdout, done.stderr, path)
    assert "MemoryError" not in done.stderr and "llama.block_count is a u64" in done.stderr


def test_a_million_empty_strings_are_read_in_bounded_time_and_memory(tmp_path):
    """A 7.6 MiB header: gguf-py's reader took 1.5 GiB and 19 s for it."""
    path = tmp_path / "strings.gguf"
    _changed(tokenizer__ggml__merges=g.strings([""] * 1_000_000)).write(path)
    start = time.perf_counter()
    done = _bounded_run(["inspect", str(path), "--json"])
    assert time.perf_counter() - start < 5 + _python_start(), done.stderr
    assert done.returncode == 0 and json.loads(done.stdout)["tokenizer"]["merges"] == 1_000_000, done.stderr
    done = _bounded_run(["verify", str(path)])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def _python_start() -> float:
    """What starting a Python that imports optkit's CLI costs on this machine (not the file's cost)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import optkit.cli.main"], check=True, cwd=ROOT)
    return time.perf_counter() - start


@needs_llama_cpp
def test_llama_cpp_aborting_on_a_file_ends_only_its_child(tmp_path):
    """block_count 0 makes llama.cpp GGML_ASSERT (abort) inside its loader: optkit's checks refuse
    it first, and the load itself, which verify and the gate run in a child, turns the abort into
    a line (the probe is called directly here, past those checks)."""
    path = tmp_path / "zero-layers.gguf"
    _changed(llama__block_count=g.scalar(g.U32, 0)).write(path)
    code = textwrap.dedent(
        f"""
        from optkit.compat.llama_cpp_load import check_llama_cpp_load
        from optkit.errors import OptkitError
        from optkit.gate.llama_cpp import LlamaCppModel
        print(check_llama_cpp_load({str(path)!r}))
        try:
            LlamaCppModel({str(path)!r}, n_ctx=64)
        except OptkitError as e:
            print("refused:", e)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr  # the optkit process survives
    problems, refusal = done.stdout.strip().splitlines()[-2:]
    assert "llama.cpp crashed loading it (SIGABRT" in problems and "n_layer" in problems
    assert refusal.startswith(f"refused: {path}: llama.cpp crashed loading it")
    done = _bounded_run(["verify", str(path)], limit_bytes=4 << 30)
    _one_line_refusal(done.returncode, done.stdout, done.stderr, path)
    assert "llama.block_count is 0" in done.stderr


def test_the_headers_arrays_together_are_bounded_not_only_each_one(tmp_path):
    """Each array under its own bound, and each item in the file: many of them still add up."""
    import struct

    u8_array = struct.pack("<IIQ", g.ARRAY, 0, 1_500_000) + bytes(1_500_000)
    path = tmp_path / "arrays.gguf"
    _changed(**{f"optkit__filler{i}": u8_array for i in range(3)}).write(path)
    done = _bounded_run(["inspect", str(path)])
    assert done.returncode == 2 and "array items in all (at most 4,194,304)" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
