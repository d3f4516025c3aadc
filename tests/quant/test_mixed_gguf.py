"""A GGUF K mix with some linears raised along ggml's types (quant/mixed_gguf.py): each raised
linear holds round-to-nearest on its new type's grid, every other tensor is the source's byte for
byte, and the manifest in the file records each layer's type and the overrides."""

import gguf
import pytest
import torch

from optkit.errors import OptkitError
from optkit.modeldir import TensorReader, read_config, resolve_model_dir
from optkit.quant.ladder import Rung
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.quant.mixed_gguf import gguf_manifest, write_mixed_gguf
from tests.quant.test_gguf_file_types import _file_linears

RAISED = {
    "model.layers.0.self_attn.q_proj": Rung.gguf("Q6_K"),  # q rows in GGML's RoPE order
    "model.layers.1.mlp.down_proj": Rung(16),
    "model.layers.2.self_attn.k_proj": Rung.gguf("Q8_0"),
}


@pytest.fixture(scope="module")
def q3_k_m(tmp_path_factory):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("mixed-gguf") / "q3_k_m.gguf"
    quantize_model("small", out, QuantizeOptions(method="rtn", format="gguf", gguf={"type": "Q3_K_M"}))
    return out


def test_raised_linears_hold_round_to_nearest_on_their_new_type_and_the_rest_is_copied(tmp_path, q3_k_m):
    base = resolve_model_dir("small")
    out = tmp_path / "mixed.gguf"
    written = write_mixed_gguf(q3_k_m, base, RAISED, out, {"note": 1})
    manifest, linears = _file_linears(out, read_config(base))
    assert manifest == gguf_manifest(out) == written and manifest["note"] == 1
    assert manifest["precision_overrides"] == {name: rung.to_json() for name, rung in RAISED.items()}
    weights = TensorReader(base)
    for name, rung in RAISED.items():
        weight = weights.get(f"{name}.weight")
        expected = weight.float() if rung.full else rtn_quantize(weight.float(), rung.scheme(None)).dequantize()
        assert linears[name][0] == ("BF16" if rung.full else rung.gguf_type)  # small is stored in bfloat16
        assert torch.equal(linears[name][1], expected), name
    layers = {layer["name"]: layer for layer in manifest["layers"]}
    assert layers["model.layers.1.mlp.down_proj"]["rel_error"] == 0.0
    assert all(layers[name]["gguf_type"] == linears[name][0] for name in layers)
    before, after = gguf.GGUFReader(q3_k_m), gguf.GGUFReader(out)
    changed = {"blk.0.attn_q.weight", "blk.1.ffn_down.weight", "blk.2.attn_k.weight"}
    assert [t.name for t in before.tensors] == [t.name for t in after.tensors]
    for old, new in zip(before.tensors, after.tensors, strict=True):
        if old.name not in changed:
            assert old.tensor_type == new.tensor_type and bytes(old.data) == bytes(new.data), old.name
    kept = [k for k in before.fields if k != "optkit.manifest" and not k.startswith("GGUF.")]
    assert kept == [k for k in after.fields if k != "optkit.manifest" and not k.startswith("GGUF.")]
    assert all(before.fields[k].contents() == after.fields[k].contents() for k in kept)


def test_raising_again_keeps_what_was_raised_and_a_scheme_that_is_no_ggml_type_is_one_line(tmp_path, q3_k_m):
    base = resolve_model_dir("small")
    first, second = tmp_path / "first.gguf", tmp_path / "second.gguf"
    write_mixed_gguf(q3_k_m, base, RAISED, first, {})
    write_mixed_gguf(first, base, {"model.layers.3.mlp.up_proj": Rung.gguf("Q5_K")}, second, {})
    overrides = gguf_manifest(second)["precision_overrides"]
    assert overrides == {
        **{n: r.to_json() for n, r in RAISED.items()},
        "model.layers.3.mlp.up_proj": {"gguf_type": "Q5_K"},
    }
    with pytest.raises(OptkitError, match="ggml's types"):
        write_mixed_gguf(q3_k_m, base, {"model.layers.3.mlp.up_proj": Rung(4, 32)}, tmp_path / "bad.gguf", {})
    with pytest.raises(OptkitError, match="not a quantized layer"):
        write_mixed_gguf(q3_k_m, base, {"lm_head.nothing": Rung.gguf("Q8_0")}, tmp_path / "bad.gguf", {})
    assert not (tmp_path / "bad.gguf").exists() and not list(tmp_path.glob(".bad.gguf.tmp-*"))
