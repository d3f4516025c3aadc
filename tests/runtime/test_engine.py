"""The engine end to end on the reference models: greedy output equals transformers', batching
and preemption never change a request's tokens, prefix caching skips the shared prefill."""

import random

import pytest
import torch

from optkit.data.eval_sets import load_text_set
from optkit.kernels import cpu_int4
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def heldout_ids(small_dir) -> list[int]:
    from optkit.modeldir import load_tokenizer

    return load_tokenizer(small_dir).encode("\n".join(load_text_set("heldout").texts[:40]))


def varied_prompts(ids: list[int], n: int, seed: int, lengths=(1, 300)) -> list[list[int]]:
    """n prompts of random lengths cut from held-out text."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(*lengths)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def strip_eos(tokens: list[int], eos: int) -> list[int]:
    """transformers pads after EOS within a batch of one it does not; keep up to the first EOS."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.slow
def test_greedy_matches_transformers_on_20_prompts(small_dir, heldout_ids):
    from optkit.modeldir import load_tokenizer

    tokenizer = load_tokenizer(small_dir)
    handwritten = ["def main():", "import os\n", "class Foo(object):\n    def", "# Copyright", "x = [i for i in"]
    prompts = [tokenizer.encode(t) for t in handwritten] + varied_prompts(heldout_ids, 15, seed=1)
    engine = LLMEngine(small_dir, EngineConfig(max_num_batched_tokens=128))  # long prompts are chunked
    ours = engine.generate(prompts, GREEDY)
    theirs = hf_greedy(small_dir, prompts, GREEDY.max_tokens)
    eos = engine.model.config.eos_token_ids[0]
    assert [strip_eos(t, eos) for t in theirs] == ours


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_artifact_greedy_matches_transformers(tmp_path, small_dir, heldout_ids, method):
    pytest.importorskip("compressed_tensors")
    from optkit.quant.calibration_data import CalibrationOptions
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    artifact = tmp_path / method
    options = QuantizeOptions(
        method=method, weights=WeightScheme(bits=4, group_size=128), calibration=CalibrationOptions(num_samples=16)
    )
    quantize_model(small_dir, artifact, options)
    prompts = varied_prompts(heldout_ids, 8, seed=2)
    # the dequantized weights that transformers runs, so greedy tokens match one for one; the CPU's W4A8
    # kernel rounds activations to int8 (a near-tie can flip), its logits are bounded in tests/models/test_loader.py
    with cpu_int4.reference_only():
        ours = LLMEngine(artifact).generate(prompts, GREEDY)
    assert hf_greedy(artifact, prompts, GREEDY.max_tokens) == ours


@pytest.mark.slow
def test_batched_equals_alone_for_64_mixed_prompts(small_dir, heldout_ids):
    prompts = varied_prompts(heldout_ids, 64, seed=3, lengths=(1, 200))
    rng = random.Random(4)
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0) for _ in prompts]
    engine = LLMEngine(small_dir, EngineConfig(max_num_seqs=64, max_num_batched_tokens=256))
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert batched == alone
    assert engine.stats().kv_cache_usage == 0


@pytest.mark.slow
def test_preemption_does_not_change_outputs(small_dir, heldout_ids):
    prompts = varied_prompts(heldout_ids, 12, seed=5, lengths=(20, 60))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLMEngine(small_dir).generate(prompts, params)
    tight = LLMEngine(small_dir, EngineConfig(kv_cache_blocks=24, block_size=16))  # ~4 sequences fit
    assert tight.generate(prompts, params) == roomy
    assert tight.stats().num_preemptions > 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(draft_dir, heldout_ids):
    engine = LLMEngine(draft_dir)
    prompt = heldout_ids[:30]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    alone = engine.generate([prompt], params)[0]
    others = varied_prompts(heldout_ids, 5, seed=6, lengths=(5, 50))
    unseeded = SamplingParams(max_tokens=20, temperature=1.0)
    batched = engine.generate([*others, prompt], [unseeded] * 5 + [params])[-1]
    assert alone == batched


def test_prefix_cache_skips_a_shared_200_token_prefill(draft_dir, heldout_ids):
    engine = LLMEngine(draft_dir, EngineConfig(block_size=16))
    prefix = heldout_ids[:200]
    engine.generate([prefix + heldout_ids[300:310]], GREEDY)
    before = engine.stats()
    engine.generate([prefix + heldout_ids[400:420]], GREEDY)
    after = engine.stats()
    hits = after.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens
    computed = after.num_prompt_tokens_computed - before.num_prompt_tokens_computed
    assert hits == 192  # the prefix's 12 full blocks of 16
    assert computed == 220 - 192


def test_stop_string_ends_the_text_before_it(draft_dir, heldout_ids):
    engine = LLMEngine(draft_dir)
    prompt = heldout_ids[:40]
    free = {}
    engine.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0), lambda i, o: free.setdefault("t", []).append(o.text)
    )
    text = "".join(free["t"])
    at = next(i for i in range(5, len(text) - 3) if text.find(text[i : i + 3]) == i)  # first occurrence
    stop = text[at : at + 3]
    parts = []
    engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=[stop]), lambda i, o: parts.append(o))
    assert "".join(o.text for o in parts) == text[:at]
    assert parts[-1].finished and parts[-1].finish_reason == "stop"


def test_request_too_long_names_the_limits(draft_dir):
    engine = LLMEngine(draft_dir, EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match="60 tokens and max_tokens is 10.*64"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10), "r")
