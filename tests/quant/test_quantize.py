import json
import mmap

import pytest
import torch
from safetensors import safe_open

from optkit.artifacts import file_sha256
from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.memory import PeakMemory
from optkit.modeldir import load_tokenizer
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.formats.load import load_model
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme


def test_artifact_layout_and_manifest(tmp_path, draft_dir):
    out = tmp_path / "q"
    options = QuantizeOptions(weights=WeightScheme(bits=4, group_size=64), ignore=["*.layers.1.mlp.down_proj"])
    manifest = quantize_model(draft_dir, out, options)

    on_disk = json.loads((out / "optkit.json").read_text())
    assert on_disk == manifest
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {"optkit.json"}
    assert all(file_sha256(out / name) == digest for name, digest in manifest["files"].items())
    assert manifest["method"] == "rtn" and manifest["options"]["weights"]["group_size"] == 64
    assert manifest["base_model"]["sha256"] and manifest["calibration"]["sha256"] == ""
    assert manifest["ignored_layers"] == ["model.layers.1.mlp.down_proj"]
    assert len(manifest["layers"]) == 2 * 7 - 1
    assert all(0 < layer["rel_error"] < 0.2 for layer in manifest["layers"])

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["model.layers.1.mlp.down_proj", "lm_head"]
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_packed").dtype == torch.int32
    assert "model.layers.0.mlp.up_proj.weight" not in keys
    assert "model.layers.1.mlp.down_proj.weight" in keys  # ignored: stays full precision
    assert "model.embed_tokens.weight" in keys
    assert (out / "tokenizer.json").exists()


@pytest.mark.parametrize("symmetric", [True, False])
def test_optkit_loads_what_it_wrote(tmp_path, draft_dir, symmetric):
    """The artifact's weights are the dequantized integers; unquantized tensors are untouched."""
    out = tmp_path / "q"
    quantize_model(draft_dir, out, QuantizeOptions(weights=WeightScheme(bits=8, symmetric=symmetric)))
    base, artifact = load_model(draft_dir), load_model(out)
    base_params, artifact_params = dict(base.named_parameters()), dict(artifact.named_parameters())
    for name, param in base_params.items():
        if "layers" in name and name.endswith("proj.weight"):
            assert not torch.equal(param, artifact_params[name])
            torch.testing.assert_close(param, artifact_params[name], atol=0.02 * param.abs().max().item(), rtol=0)
        else:
            assert torch.equal(param, artifact_params[name]), name


def test_transformers_loads_the_artifact_with_the_same_logits(tmp_path, small_dir):
    """Acceptance: a 4-bit RTN artifact loads in plain transformers and its logits on the eval
    set match optkit's, computed from its own dequantized weights, within 1e-3 (fp32)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "small-w4"
    quantize_model(small_dir, out, QuantizeOptions(weights=WeightScheme(bits=4, group_size=128)))
    windows = pack_windows(tokenize_stream(load_tokenizer(small_dir), load_text_set("heldout").texts), 256, 8)
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out)
    with torch.inference_mode():
        max_diff = max((hf_model(w).logits - ours(w).logits).abs().max().item() for w in windows.split(4))
    assert max_diff < 1e-3


def test_a_peak_window_inside_another_keeps_the_outer_peak():
    """The benchmark's window around quantize_model must still see the peaks before the
    manifest's own window starts (both use the process's one peak counter)."""
    with PeakMemory() as outer:
        # 64 MiB of fresh pages, written, then unmapped (an allocator could reuse resident memory)
        block = mmap.mmap(-1, 64 * 2**20)
        block.write(b"\1" * len(block))
        block.close()
        with PeakMemory() as inner:
            pass
    if outer.rss_bytes is None:
        pytest.skip("this OS does not report the peak resident set")
    assert outer.rss_bytes >= 60 * 2**20 > inner.rss_bytes


def test_a_sharded_base_gives_the_same_artifact(tmp_path, draft_dir):
    """Models of a few GB and up come in safetensors shards with an index: the artifact is the
    same as from one file, and the base's index is not copied next to the single output file."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(draft_dir).save_pretrained(sharded, max_shard_size="300KB")
    for side_file in draft_dir.iterdir():
        if side_file.name.startswith("tokenizer"):
            (sharded / side_file.name).write_bytes(side_file.read_bytes())
    assert len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").exists()

    options = QuantizeOptions(method="gptq", calibration=CalibrationOptions(num_samples=4, seq_len=32))
    quantize_model(draft_dir, tmp_path / "from-one", options)
    quantize_model(sharded, tmp_path / "from-shards", options)
    one, shards = (load_file(tmp_path / d / "model.safetensors") for d in ("from-one", "from-shards"))
    assert one.keys() == shards.keys()
    assert all(torch.equal(one[k], shards[k]) for k in one)
    assert not (tmp_path / "from-shards" / "model.safetensors.index.json").exists()
