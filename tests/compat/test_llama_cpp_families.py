"""The compatibility matrix's llama.cpp column across the families: a family optkit serves, written as
GGUF by `--gguf-type` (Q8_0, and the Q4_K_M mix), loads in llama.cpp and computes what optkit's
runtime computes on the file's own weights (dequantized by gguf-py, the converter's steps undone:
gguf_weights.py): the same top token at ≥ 98% of positions and a perplexity within 1% (CELLS: where
that holds; the numbers of the rest beside it).

The test models' widths are multiples of 256 (hidden 256, MLPs 512, experts 256, heads of 64), so
that every linear also fits a K-quant's super-blocks. A random model's next-token distribution is
nearly flat, so its top token is a near tie that llama.cpp's 8-bit activations flip at random: the
embedding (and head) rows get norms spread over e^±1, as trained vocabularies have, and the text is
sampled from the model itself, so the top token and the perplexity mean what they mean for a trained
model. Likewise a random router's top-k is a near tie for many tokens, and a flipped expert changes
the layer's output wholesale: the routers' logits are scaled up (ROUTER_SCALE), as trained routers
choose their experts clearly."""

import functools
import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from optkit.compat import matrix
from optkit.gate.llama_cpp import llama_cpp_available
from optkit.quant.formats.gguf_mix import linear_scheme
from optkit.quant.formats.gguf_weights import write_reference_dir
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.kquants import K_TYPES
from tests.compat.test_llama_cpp_column import assert_llama_cpp_agrees
from tests.compat.test_matrix import _versions
from tests.tiny_families import save_tiny_family

WIDE = dict(hidden_size=256, intermediate_size=512)
HEADS = dict(head_dim=64)
GEMMA = dict(HEADS, query_pre_attn_scalar=64)
# per family: what makes its test model's widths multiples of 256, and the model llama.cpp's graph runs
# (Qwen3 without attention biases; Qwen2-MoE with every layer sparse)
GGUF_MODELS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": dict(HEADS, attention_bias=False),
    "granite": {},
    "olmo2": {},
    "phi3": dict(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0 + 0.05 * i for i in range(32)],
            "long_factor": [1.0 + 1.0 * i for i in range(32)],
        }
    ),
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "gemma3": GEMMA,
    "mixtral": {},
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=512, mlp_only_layers=[]),
    "qwen3_moe": dict(HEADS, moe_intermediate_size=256),
}
SEQUENCES, LENGTH, PROMPT = 16, 64, 4
ROUTER_SCALE = 4.0
ROUTERS = ("block_sparse_moe.gate.weight", "mlp.gate.weight")  # Mixtral's, Qwen-MoE's
# the cells that hold the line. The others fall short by llama.cpp's 8-bit activations (q8_0, q8_K) on
# these random models' near ties, not by the weights: at Q8_0 llama 97.9%, mistral 97.9%, qwen3 97.8%,
# phi3 97.3% of the top tokens, qwen3_moe's perplexity +1.6%; at Q4_K_M olmo2 97.5%, gemma2 97.7%,
# qwen2_moe 97.7% (on AVX2 and on AMX CPUs with ggml's extra buffer types off; it held on an earlier CPU);
# llama.cpp on an F32 file of the same dequantized weights agrees at 100%, perplexity within 0.02%
CELLS = {
    "Q8_0": ("qwen2", "granite", "olmo2", "gemma2", "gemma3_text", "gemma3", "mixtral", "qwen2_moe"),
    "Q4_K_M": ("qwen2", "granite", "gemma3_text", "gemma3", "mixtral"),
}


@pytest.fixture(scope="session")
def gguf_model_dir(tmp_path_factory, draft_dir):
    """family -> its test model with widths of multiples of 256 (saved once per session)."""
    made = {}

    def make(family: str):
        if family not in made:
            # a neutral directory name: general.name comes from it, and llama.cpp sets token attributes
            # by name (a "phi3" name expects Phi-3's SentencePiece tokens)
            out = tmp_path_factory.mktemp("gguf-models") / f"model-{len(made)}"
            made[family] = _like_a_trained_model(
                save_tiny_family(family, out, draft_dir, **WIDE, **GGUF_MODELS[family])
            )
        return made[family]

    return make


def _like_a_trained_model(model_dir: Path) -> Path:
    """The embedding and head rows scaled by e^N(0, 1): some tokens clearly likelier than others;
    the routers' rows by ROUTER_SCALE: some experts clearly better for a token than the others."""
    tensors = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for key, tensor in tensors.items():
        if key.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensors[key] = tensor * torch.randn(tensor.shape[0], 1, generator=generator).exp()
        if key.endswith(ROUTERS):
            tensors[key] = tensor * ROUTER_SCALE
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@functools.cache
def _sampled_text(model_dir: Path) -> torch.Tensor:
    """SEQUENCES × LENGTH tokens: PROMPT random ones, then what transformers' model samples after them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        # llama.cpp and optkit's runtime take LongRoPE's long factors for a context (256) beyond the
        # original (64) at every position; transformers only for a sequence beyond it: so it samples
        # with the long factors in the short ones' place
        config.rope_parameters = {**rope, "short_factor": rope["long_factor"]}
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    prompt = torch.randint(
        0, model.config.get_text_config().vocab_size, (SEQUENCES, PROMPT), generator=torch.Generator().manual_seed(0)
    )
    torch.manual_seed(0)
    with torch.no_grad():
        new = LENGTH - prompt.shape[1]
        return model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0, max_new_tokens=new,
            min_new_tokens=new, pad_token_id=0,
        )  # fmt: skip


def _cells():
    """CELLS, Q8_0 on every run and the K mixes with the slow tests."""
    for file_type, families in CELLS.items():
        for family in families:
            yield pytest.param(family, file_type, marks=() if file_type == "Q8_0" else pytest.mark.slow)


@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
@pytest.mark.parametrize(("family", "file_type"), list(_cells()))
def test_a_family_in_a_file_type_computes_in_llama_cpp_what_optkit_does(
    tmp_path, gguf_model_dir, record, family, file_type
):
    model = gguf_model_dir(family)
    path = tmp_path / "model.gguf"
    quantize_model(model, path, QuantizeOptions(method="rtn", format="gguf", gguf={"type": file_type}))
    scheme = linear_scheme(file_type)
    scheme = scheme if isinstance(scheme, dict) else scheme.model_dump()
    if "_K" in file_type:  # the widths of 256: no linear falls back off the K types
        manifest = json.loads(gguf.GGUFReader(path).fields["optkit.manifest"].contents())
        assert {layer["gguf_type"] for layer in manifest["layers"]} <= set(K_TYPES)
    # LongRoPE's long factors on both sides: a context (256, the test models') beyond Phi-3's original
    assert_llama_cpp_agrees(path, _sampled_text(model), write_reference_dir(path, model, tmp_path / "ref"), 256, PROMPT)
    versions = {**_versions(), "llama-cpp-python": matrix.installed_version("llama-cpp-python")}
    cell = {"row": f"{family} (tiny, random)", "method": "rtn", "kind": f"gguf {file_type}", "format": "gguf"}
    cell.update(versions=versions, bits=scheme["bits"], symmetric=scheme["symmetric"], w8a8=False, type="int")
    record({**cell, "loader": matrix.LLAMA_CPP, "status": "loads"})
