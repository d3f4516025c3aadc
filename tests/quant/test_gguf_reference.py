"""The reference the llama.cpp column is checked against (gguf_weights.write_reference_dir) holds a
file's weights as llama.cpp computes with them. A tied model's file for OLMo 2 or Qwen2-MoE (whose
llama.cpp loaders have no tied output) holds the embedding again as output.weight, at the output's own
type: llama.cpp's logits come from it, so the reference's must too (they came from the embedding at
the embedding's type, and the families fell to 84-97% of the top tokens). A file without its own
output stays tied."""

import json

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from optkit.models.loader import load_runtime_model
from optkit.quant.formats.gguf_weights import write_reference_dir
from optkit.quant.quantize import QuantizeOptions, quantize_model
from tests.tiny_families import save_tiny_family

Q4_0 = QuantizeOptions(method="rtn", format="gguf", gguf={"type": "Q4_0"})


def dequantized(path, name: str) -> torch.Tensor:
    (info,) = [t for t in gguf.GGUFReader(path).tensors if t.name == name]
    return torch.from_numpy(quants.dequantize(info.data, GGMLQuantizationType(info.tensor_type))).float()


@pytest.mark.parametrize("family, own_output", [("olmo2", True), ("llama", False)])
def test_the_reference_takes_the_logits_from_the_files_own_output(tmp_path, draft_dir, family, own_output):
    model = save_tiny_family(family, tmp_path / "model", draft_dir, tie_word_embeddings=True)
    path = tmp_path / "model.gguf"
    quantize_model(model, path, Q4_0)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in types) == own_output

    reference = write_reference_dir(path, model, tmp_path / "reference")
    config = json.loads((reference / "config.json").read_text())
    runtime = load_runtime_model(reference)
    assert config["tie_word_embeddings"] == (not own_output) and (runtime.lm_head is None) == (not own_output)
    if own_output:
        assert types["output.weight"] != types["token_embd.weight"]  # two approximations of one matrix
        assert torch.equal(runtime.lm_head.weight, dequantized(path, "output.weight"))
        assert not torch.equal(runtime.lm_head.weight, runtime.get_input_embeddings().weight)
