"""--kv-cache-dtype int8|fp8 in the engine: the same --kv-cache-blocks hold twice the sequences, the
bytes per token are reported, and prefix caching and speculative decoding work on the 8-bit cache."""

import pytest

from optkit.errors import OptkitError
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.engine_args import EngineArgs
from optkit.runtime.sequence import SamplingParams
from optkit.server.metrics import EngineCollector

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(draft_dir) -> list[int]:
    from optkit.data.eval_sets import load_text_set
    from optkit.modeldir import load_tokenizer

    return load_tokenizer(draft_dir).encode("\n".join(load_text_set("heldout").texts[:20]))


def _peak_running(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> int:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"r{i}")
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.stats().num_running)
    return peak


def test_the_same_kv_blocks_hold_twice_the_sequences_in_8_bits(draft_dir, prompt_ids):
    prompts = [prompt_ids[i * 50 : i * 50 + 46] for i in range(24)]  # with 2 new tokens: 3 blocks of 16 each
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    full = LLMEngine(
        draft_dir, EngineConfig(dtype="bfloat16", kv_cache_blocks=24, max_num_seqs=24, max_num_batched_tokens=2048)
    )
    eight = LLMEngine(
        draft_dir,
        EngineConfig(
            dtype="bfloat16", kv_cache_blocks=24, max_num_seqs=24, max_num_batched_tokens=2048, kv_cache_dtype="int8"
        ),
    )
    head_dim = full.model.config.head_dim  # 32 for draft (2 layers, 2 KV heads): 64 bytes per token and head at bf16
    assert full.stats().kv_cache_bytes_per_token == 2 * 2 * 2 * head_dim * 2
    # 8 bits: half the data, plus one float32 scale per block, layer, K/V and head spread over 16 tokens
    assert eight.stats().kv_cache_bytes_per_token == 2 * 2 * 2 * head_dim + 2 * 2 * 2 * 4 / 16
    assert eight.stats().num_kv_blocks == 48  # exactly twice the blocks, the scales on top
    held = sum(k.nbytes + v.nbytes for k, v in eight.runner.kv_caches)  # what the caches really hold
    assert held == eight.stats().kv_cache_bytes_per_token * 48 * 16
    gauges = {f.name: f.samples[0].value for f in EngineCollector(eight).collect() if f.samples}
    assert gauges["optkit:kv_cache_bytes_per_token"] == eight.stats().kv_cache_bytes_per_token  # what /metrics shows
    full_peak, eight_peak = _peak_running(full, prompts, params), _peak_running(eight, prompts, params)
    assert (full_peak, eight_peak) == (8, 16)  # 24 blocks hold 8 such sequences, 48 hold 16: 2x


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_prefix_cache_hits_and_speculative_decoding_work_on_an_8bit_cache(draft_dir, prompt_ids, kv_dtype):
    plain = LLMEngine(draft_dir, EngineConfig(kv_cache_dtype=kv_dtype))
    prompt = prompt_ids[:100]
    first = plain.generate([prompt], GREEDY)[0]
    again = plain.generate([prompt], GREEDY)[0]  # its 6 full blocks come from the prefix cache
    assert plain.stats().num_prefix_cache_hit_tokens >= 96
    assert again == first
    spec = LLMEngine(draft_dir, EngineConfig(kv_cache_dtype=kv_dtype, speculative="ngram"))
    assert spec.generate([prompt], GREEDY)[0] == first  # greedy: token for token the same
    assert spec.stats().num_spec_draft_tokens > 0
    reference = LLMEngine(draft_dir).generate([prompt], GREEDY)[0]
    assert (
        sum(a == b for a, b in zip(first, reference, strict=True)) >= len(reference) // 2
    )  # 8 bits: close to full precision


def test_an_unknown_kv_cache_dtype_is_one_line():
    with pytest.raises(OptkitError, match="--kv-cache-dtype 'int4'"):
        EngineArgs(kv_cache_dtype="int4")


def test_eval_gates_the_artifact_through_an_8bit_cache(run_cli, draft_dir):
    import json

    metrics = {}
    for kv_dtype in ("auto", "int8"):
        args = ("eval", draft_dir, "--baseline", draft_dir, "--kv-cache-dtype", kv_dtype, "--max-windows", "4")
        code, out, err = run_cli(*args, "--json")
        assert code == 0, err
        metrics[kv_dtype] = json.loads(out)["metrics"]
    assert metrics["auto"]["kld_mean"] < 1e-5  # the runtime's paged attention computes what transformers does
    assert 1e-5 < metrics["int8"]["kld_mean"] < 1e-2  # the 8-bit cache is in the path, and costs little
    assert abs(metrics["int8"]["ppl_increase_pct"]) < 1.0


def test_decode_like_writes_read_what_one_prefill_reads_and_stay_close_in_8_bits(draft_dir, prompt_ids):
    """PagedLM with chunk_size 1 writes the cache a token at a time (each int8 block's scale grows and
    requantizes its rows); with a full-precision cache it computes what one prefill does."""
    import torch

    from optkit.models.loader import load_runtime_model
    from optkit.models.paged_lm import PagedLM

    model = load_runtime_model(draft_dir)
    ids = torch.tensor([prompt_ids[:40], prompt_ids[40:80]])  # 2 windows of 40 tokens: 3 blocks each
    prefill = PagedLM(model)(ids).logits
    torch.testing.assert_close(PagedLM(model, chunk_size=1)(ids).logits, prefill, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(PagedLM(model, chunk_size=7)(ids).logits, prefill, rtol=1e-4, atol=1e-4)
    for kv_dtype in ("int8", "fp8"):
        decode = PagedLM(model, kv_dtype, chunk_size=1)(ids).logits
        assert not torch.equal(decode, prefill)  # the 8-bit cache is in the path
        p, log_q = prefill.log_softmax(-1), decode.log_softmax(-1)
        kld = (p.exp() * (p - log_q)).sum(-1).mean().item()  # mean KL(prefill || decode) per token
        assert kld < {"int8": 5e-4, "fp8": 3e-3}[kv_dtype], (kv_dtype, kld)  # measured 7e-5 and 7e-4
