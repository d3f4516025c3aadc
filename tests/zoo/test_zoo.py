import math

import pytest
import torch

from optkit.data.corpus import split_of, stdlib_files
from optkit.zoo.specs import SPECS
from optkit.zoo.tokenizer import train_tokenizer


def test_split_is_by_file_and_stable():
    train, heldout = stdlib_files("train"), stdlib_files("heldout")
    assert train and heldout and set(train).isdisjoint(heldout)
    assert 0.03 < len(heldout) / (len(train) + len(heldout)) < 0.15
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    assert not any("test" in p.parts for p in train + heldout)


def test_tokenizer_training_is_deterministic_and_round_trips():
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 20
    first, second = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert first.get_vocab() == second.get_vocab()
    assert first.decode(first("    return a + b")["input_ids"]) == "    return a + b"


def test_reference_specs_have_the_promised_sizes(draft_dir, small_dir):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    small = AutoModelForCausalLM.from_pretrained(small_dir)
    assert 0.5e6 < draft.num_parameters() < 1.5e6
    assert 4e6 < small.num_parameters() < 8e6
    assert small.config.num_key_value_heads < small.config.num_attention_heads  # grouped-query attention
    assert draft.config.vocab_size == small.config.vocab_size


def test_bundled_models_share_one_tokenizer(draft_dir, small_dir):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(draft_dir).get_vocab() == AutoTokenizer.from_pretrained(small_dir).get_vocab()


def test_short_build_through_the_cli(run_cli, tmp_path):
    """`optkit zoo build` end to end, with a few steps of training instead of the full recipe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "draft"
    code, stdout, stderr = run_cli("zoo", "build", "draft", "--out", out, "--steps", "4", "--json")
    assert code == 0, stderr
    import json

    report = json.loads(stdout)
    assert report["steps"] == 4 and math.isfinite(report["heldout_perplexity"])
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size == SPECS["draft"].hidden_size
    assert next(model.parameters()).dtype == torch.bfloat16
    assert len(tokenizer) == model.config.vocab_size
    assert list(out.glob("*.safetensors")) and not list(out.glob("*.bin"))


def test_a_spec_names_its_family_and_gets_that_familys_class():
    """small-qwen3 is Qwen3ForCausalLM on Qwen3Config's defaults with small's sizes (heads of 64, q/k
    norms, no attention biases); an MoE spec of Qwen3-MoE gets its experts under Qwen's names; a
    Gemma 3 spec is the image-and-text model around the text config; experts on Llama are refused."""
    from transformers import Gemma3ForConditionalGeneration, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from optkit.errors import OptkitError
    from optkit.zoo.specs import ZooSpec
    from optkit.zoo.train import new_model

    model = new_model(SPECS["small-qwen3"], 4096, 0)
    assert type(model) is Qwen3ForCausalLM and model.config.head_dim == 64
    assert model.config.hidden_size == SPECS["small"].hidden_size and not model.config.attention_bias
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (64,)
    sizes = dict(hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=256, steps=1)
    moe = ZooSpec("m", **sizes, num_experts=4, experts_per_token=2, model_type="qwen3_moe", config={"head_dim": 64})
    model = new_model(moe, 4096, 0)
    assert type(model) is Qwen3MoeForCausalLM and model.config.num_experts == 4
    assert model.config.moe_intermediate_size == 256 and model.config.output_router_logits
    gemma = new_model(ZooSpec("g", **sizes, model_type="gemma3", config={"head_dim": 64}), 4096, 0)
    assert type(gemma) is Gemma3ForConditionalGeneration and gemma.config.text_config.hidden_size == 256
    with pytest.raises(OptkitError, match="experts need one of"):
        ZooSpec("x", **sizes, num_experts=4, experts_per_token=2)


def _heldout_windows(model_dir, count: int, length: int = 128) -> torch.Tensor:
    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import pack_windows, tokenize_stream
    from optkit.modeldir import load_tokenizer

    return pack_windows(tokenize_stream(load_tokenizer(model_dir), load_text_set("heldout").texts), length)[:count]


def test_small_moe_is_a_standard_mixtral_checkpoint_that_routes(small_moe_dir, small_dir):
    """4 experts, 2 per token, small's active MLP width and tokenizer; the router spreads held-out
    tokens over every expert (no dead or monopolizing expert)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optkit.zoo.train import expert_token_shares

    model = AutoModelForCausalLM.from_pretrained(small_moe_dir, dtype=torch.float32).eval()
    small = AutoModelForCausalLM.from_pretrained(small_dir)
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 4
    experts_per_token = model.config.num_experts_per_tok
    assert experts_per_token * model.config.intermediate_size == small.config.intermediate_size
    assert (
        AutoTokenizer.from_pretrained(small_moe_dir).get_vocab() == AutoTokenizer.from_pretrained(small_dir).get_vocab()
    )
    shares = expert_token_shares(model, _heldout_windows(small_moe_dir, 8))
    assert torch.allclose(shares.sum(dim=1), torch.ones(shares.shape[0]))
    assert shares.min() > 0.05 and shares.max() < 0.6, shares


def test_small_moe_gives_the_same_logits_in_transformers_and_the_runtime(small_moe_dir):
    from transformers import AutoModelForCausalLM

    from optkit.models.loader import load_runtime_model
    from tests.models.paged import run_paged, whole_prefills

    hf = AutoModelForCausalLM.from_pretrained(small_moe_dir, dtype=torch.float32).eval()
    runtime = load_runtime_model(small_moe_dir)
    sequences = _heldout_windows(small_moe_dir, 3, 96).tolist()
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([s])).logits[0] for s in sequences])
    got = torch.cat(run_paged(runtime, sequences, whole_prefills([len(s) for s in sequences]), block_size=16))
    diff = (got.float() - expected).abs().amax(dim=-1)  # per token
    # equal up to float rounding, except where rounding flips a near-tie between two experts
    assert (diff > 1e-3).float().mean() <= 0.01 and diff.max() <= 5e-2, diff.topk(5)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.99


@pytest.mark.slow
def test_short_moe_build_saves_a_mixtral_checkpoint_and_reports_the_routing(run_cli, tmp_path):
    """`optkit zoo build small-moe`, 2 steps: trained with the load-balancing loss, saved as a
    standard Mixtral checkpoint (per-expert keys, no training-only config), routing shares reported."""
    import json

    from safetensors import safe_open
    from transformers import AutoConfig

    out = tmp_path / "small-moe"
    code, stdout, stderr = run_cli("zoo", "build", "small-moe", "--out", out, "--steps", "2", "--json")
    assert code == 0, stderr
    shares = json.loads(stdout)["expert_shares"]
    assert len(shares) == SPECS["small-moe"].num_layers and all(abs(sum(s) - 1) < 1e-5 for s in shares)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "mixtral" and not config.output_router_logits
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in set(f.keys())


def test_a_bundled_model_is_rebuilt_in_place_but_never_over_a_file_someone_added(tmp_path, monkeypatch):
    """`make models` replaces the bundled folders (optkit's own, no optkit.json); a folder holding a
    file save_pretrained does not write is refused before any training, as every other output
    optkit did not write."""
    from optkit.errors import OptkitError
    from optkit.zoo import train

    bundled = tmp_path / "models"
    monkeypatch.setattr(train, "BUNDLED_DIR", bundled)
    out = bundled / "draft"
    train.build_reference_model(SPECS["draft"], out, steps=1, overwrite=True)
    before = (out / "model.safetensors").stat().st_ino
    train.build_reference_model(SPECS["draft"], out, steps=1, overwrite=True)  # rebuilt in place
    assert (out / "model.safetensors").stat().st_ino != before and not (out / "optkit.json").exists()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OptkitError, match="notes.txt is not listed"):
        train.build_reference_model(SPECS["draft"], out, steps=1, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    # outside the bundled location, save_pretrained's names alone never make a folder optkit's
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    with pytest.raises(OptkitError, match="not an optkit output"):
        train.build_reference_model(SPECS["draft"], elsewhere, steps=1, overwrite=True)
