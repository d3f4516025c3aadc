"""`optkit verify model.gguf` and `optkit inspect model.gguf`: a good file passes and is described as
a llama.cpp user asks; a truncated, mislabelled or corrupted file, or one without the metadata or
tensors llama.cpp needs, is refused with exit 2 and a line naming the problem."""

import json
import shutil
import struct

import numpy as np
import pytest

from optkit.modeldir import BUNDLED_DIR
from optkit.quant.formats.gguf_header import read_header
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.tiny_families import save_tiny_family

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny Llama as RTN Q4_0 with a chat template (an optkit file; the checks read any GGUF)."""
    root = tmp_path_factory.mktemp("gguf-verify")
    model = save_tiny_family("llama", root / "llama", BUNDLED_DIR / "small")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    out = root / "model.gguf"
    quantize_model(
        model, out, QuantizeOptions(method="rtn", weights=WeightScheme(bits=4, group_size=32), format="gguf")
    )
    return out


def _copy(good, tmp_path, name="bad.gguf"):
    return shutil.copy(good, tmp_path / name)


def _replace_once(path, old: bytes, new: bytes) -> None:
    """Rename a key or a tensor in place (same length, so every offset stays valid)."""
    data = path.read_bytes()
    assert len(old) == len(new) and data.count(old) == 1, old
    path.write_bytes(data.replace(old, new))


def test_a_good_file_verifies(run_cli, good):
    code, out, err = run_cli("verify", good)
    assert code == 0, err
    assert "ok" in out and "layout, metadata, tensors, values" in out
    code, out, _ = run_cli("verify", good, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["problems"] == [] and report["format"] == "gguf"
    assert report["tensors"] == len(read_header(good).tensors)
    assert report["checked"][:4] == ["layout", "metadata", "tensors", "values"]


@pytest.mark.parametrize("cut", [6, 30, 2000, -1, -100_000])
def test_a_truncated_file_is_named_truncated_wherever_it_is_cut(run_cli, good, tmp_path, cut):
    bad = _copy(good, tmp_path)
    size = bad.stat().st_size
    with bad.open("r+b") as f:
        f.truncate(cut if cut > 0 else size + cut)
    for command in ("verify", "inspect"):
        code, out, err = run_cli(command, bad)
        assert code == 2, (command, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "truncated" in lines[0] and str(bad) in lines[0], (command, err)


def test_a_file_that_is_not_gguf_is_named_by_its_magic(run_cli, good, tmp_path):
    bad = _copy(good, tmp_path)
    with bad.open("r+b") as f:
        f.write(b"GGML")
    code, out, err = run_cli("verify", bad)
    assert code == 2 and err.strip() == f"error: {bad} is not a GGUF file: it starts with b'GGML', not b'GGUF'"
    code, out, _ = run_cli("verify", bad, "--json")
    report = json.loads(out)
    assert code == 2 and not report["ok"] and "not a GGUF file" in report["problems"][0]


def test_missing_metadata_llama_cpp_needs_is_named(run_cli, good, tmp_path):
    bad = _copy(good, tmp_path)
    # the key, then its value type (4: uint32); head_count_kv's key goes on with "_kv"
    _replace_once(bad, b"llama.attention.head_count\x04", b"llama.attention.head_coun_\x04")
    code, out, err = run_cli("verify", bad)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: {bad}: missing metadata llama.attention.head_count: llama.cpp needs it to load a llama model"
    ]


def test_a_missing_tensor_is_named(run_cli, good, tmp_path):
    bad = _copy(good, tmp_path)
    _replace_once(bad, b"blk.1.ffn_up.weight", b"blk.1.ffn_XX.weight")
    code, _, err = run_cli("verify", bad)
    assert code == 2 and "missing tensor blk.1.ffn_up.weight: llama.cpp's llama graph needs it" in err


def test_a_block_whose_scale_is_nan_is_named(run_cli, good, tmp_path):
    bad = _copy(good, tmp_path)
    header = read_header(bad)
    target = next(t for t in header.tensors if t.name == "blk.0.attn_v.weight")
    assert target.type_id == 2  # Q4_0: fp16 d, then 16 bytes of nibbles
    with bad.open("r+b") as f:
        f.seek(header.data_start + target.offset + 18 * 3)  # the fourth block's d
        f.write(np.float16(np.nan).tobytes())
    code, _, err = run_cli("verify", bad)
    assert code == 2 and "tensor blk.0.attn_v.weight (Q4_0): 1 scales are NaN or infinite" in err


def test_a_tensor_pointing_past_the_end_of_the_file_is_refused(run_cli, good, tmp_path):
    """A corrupted offset (not a short file): the tensor's bytes by its type and shape lie outside."""
    bad = _copy(good, tmp_path)
    header = read_header(bad)
    name = b"output_norm.weight"
    data = bytearray(bad.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    offset_at = at + 4 + 8 * n_dims + 4
    struct.pack_into("<Q", data, offset_at, header.file_size)
    bad.write_bytes(bytes(data))
    code, _, err = run_cli("verify", bad)
    assert code == 2 and "tensor output_norm.weight needs bytes up to" in err


def test_inspect_describes_the_file_as_a_llama_cpp_user_asks(run_cli, good):
    code, out, err = run_cli("inspect", good, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["architecture"] == "llama" and info["file_type"] == "Q4_0" and info["gguf_version"] == 3
    assert info["hyperparameters"]["context_length"] > 0 and info["hyperparameters"]["block_count"] == 2
    assert info["tokenizer"]["model"] == "gpt2" and info["tokenizer"]["vocab_size"] == 4096
    assert info["chat_template"] == {"present": True, "chars": len(TEMPLATE)}
    assert info["optkit"]["method"] == "rtn"
    tensors = info["tensors"]
    assert sum(t["count"] for t in info["groups"]) == len(tensors) == len(read_header(good).tensors)
    by_type = {row["type"]: row for row in info["types"]}
    assert by_type["Q4_0"]["bits_per_weight"] == 4.5  # 18 bytes per 32 weights
    assert sum(row["bytes"] for row in info["types"]) <= info["size_bytes"]
    assert {"name": "blk.*.attn_q.weight", "type": "Q4_0"}.items() <= next(
        g for g in info["groups"] if g["name"] == "blk.*.attn_q.weight"
    ).items()
    code, out, _ = run_cli("inspect", good)
    assert code == 0 and "chat template" in out and "blk.*.attn_q.weight" in out and "bits/weight" in out
