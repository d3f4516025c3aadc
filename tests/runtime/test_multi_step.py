"""Multi-step decoding (runtime/multi_step.py): an engine step that runs several decode steps gives
every request the tokens, text, logprobs and finish reasons of one decode step at a time, stops
where one step at a time stops, gives back the slots it reserved, and never holds up a request
that arrives."""

import pytest
import torch

from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.model_runner import ModelRunner
from optkit.runtime.sequence import SamplingParams
from tests.kernels.test_cpu_decode import w4_artifact

PROMPTS = [list(range(5, 30)), list(range(100, 107)), list(range(300, 341)), [7, 8, 9]]


def engine(model_dir, steps: int) -> LLMEngine:
    # blocks of 4 tokens: the reserved slots of a multi-step cross block boundaries
    return LLMEngine(model_dir, EngineConfig(num_scheduler_steps=steps, block_size=4, max_model_len=256))


def outputs(eng: LLMEngine, prompts, params) -> dict[str, tuple]:
    """Every request's tokens, text, finish reason and logprobs, as its outputs streamed them."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(prompt, p, f"r{i}")
    seen: dict[str, list] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens, text, reason, logprobs = seen.setdefault(out.request_id, [[], "", None, []])
            seen[out.request_id] = [tokens + out.token_ids, text + out.text, out.finish_reason, logprobs]
            if out.logprobs:
                logprobs += [(lp.token_id, round(lp.logprob, 5), [t for t, _ in lp.top]) for lp in out.logprobs]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # the reserved slots given back
    return {request: tuple(value) for request, value in seen.items()}


def counted_runs(monkeypatch) -> list[int]:
    """The number of steps of each multi-step ModelRunner.run_decode_steps ran."""
    calls = []
    real = ModelRunner.run_decode_steps
    monkeypatch.setattr(
        ModelRunner, "run_decode_steps", lambda self, s, n, choose: calls.append(n) or real(self, s, n, choose)
    )
    return calls


@pytest.fixture(params=["llama fp32", "llama 4-bit", "gemma3_text 4-bit"])
def model_dir(request, tmp_path, small_dir):
    """The reference model, and 4-bit artifacts whose decode steps run the fused stack (Gemma 3: two KV
    cache groups, sliding and full, and two RoPE tables)."""
    if request.param == "llama fp32":
        return small_dir
    return w4_artifact(request.param.split()[0], tmp_path, small_dir)


def test_many_steps_at_once_give_one_step_at_a_times_requests(model_dir, monkeypatch):
    from optkit.modeldir import load_tokenizer

    plain = outputs(engine(model_dir, 1), PROMPTS, [SamplingParams(max_tokens=30, temperature=0)] * 4)
    # stops inside a multi-step: a stop token, a stop string, a max_tokens that no step count divides
    first_seen = {}  # token -> where it first appears in r1's output
    for i, token in enumerate(plain["r1"][0]):
        first_seen.setdefault(token, i)
    stop_token = max(first_seen, key=first_seen.get)  # the token that appears last for the first time
    stop_text = load_tokenizer(model_dir).decode(plain["r2"][0][:9])[-4:]
    params = [
        SamplingParams(max_tokens=23, temperature=0, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=30, temperature=0, stop=[stop_text]),
        SamplingParams(max_tokens=19, temperature=0.8, top_p=0.9, seed=7),  # seeded: one draw per token, in order
    ]
    want = outputs(engine(model_dir, 1), PROMPTS, params)
    runs = counted_runs(monkeypatch)
    got = outputs(engine(model_dir, 5), PROMPTS, params)
    assert got == want
    assert want["r1"][2] == want["r2"][2] == "stop" and len(want["r1"][0]) == first_seen[stop_token] + 1
    assert max(runs) == 5 and sum(runs) >= 20  # most of the 19-30 tokens a request decodes came from multi-steps


def test_a_request_that_arrives_is_admitted_at_the_next_step(small_dir, monkeypatch):
    runs = counted_runs(monkeypatch)
    eng = engine(small_dir, 8)
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0), "first")
    eng.step()  # the prefill
    eng.step()
    assert runs == [8]
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0), "second")
    (out,) = [o for o in eng.step() if o.request_id == "second"]  # its prefill: a one-token step with it
    assert out.token_ids and runs == [8]
    eng.step()
    assert runs == [8, 8]


def test_penalties_and_short_requests_take_single_steps(small_dir, monkeypatch):
    runs = counted_runs(monkeypatch)
    eng = engine(small_dir, 8)
    outputs(eng, PROMPTS[:1], [SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3)])
    assert runs == []  # a penalty reads the tokens a multi-step would only append at its end
    outputs(eng, PROMPTS[:1], [SamplingParams(max_tokens=12, temperature=0)])
    assert runs == [8, 3]  # the first token came from the prefill; the last run stops at max_tokens


def test_a_multi_step_stops_where_the_cache_ends(small_dir, monkeypatch):
    """A cache of 5 blocks of 4 holds 20 tokens: after a 16-token prompt, 4 steps at once, then the end."""
    runs = counted_runs(monkeypatch)
    prompt, params = [list(range(5, 21))], [SamplingParams(max_tokens=30, temperature=0)]
    small = {"block_size": 4, "kv_cache_blocks": 5, "max_model_len": 64}
    got = outputs(LLMEngine(small_dir, EngineConfig(num_scheduler_steps=8, **small)), prompt, params)
    want = outputs(LLMEngine(small_dir, EngineConfig(num_scheduler_steps=1, **small)), prompt, params)
    assert got == want and runs == [4] and got["r0"][2] == "length" and len(got["r0"][0]) == 5


def tiny_random_llama(out) -> object:
    """A 2-layer random Llama with a byte-level tokenizer trained on a few lines: no reference model to
    train first (the device machine starts bare)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from optkit.zoo.tokenizer import train_tokenizer

    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]
    tokenizer = train_tokenizer(texts, vocab_size=512)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu/run.sh runs it on the device)")
def test_cuda_multi_steps_give_one_step_at_a_times_greedy_tokens(tmp_path):
    """Opt-in on CUDA (`--num-scheduler-steps 4`): the eager decode steps' tokens, in bfloat16."""
    model_dir = tiny_random_llama(tmp_path / "tiny")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (23, 30, 19, 30)]
    prompts = [[t % 512 for t in prompt] for prompt in PROMPTS]
    settings = {"device": "cuda", "dtype": "bfloat16", "enforce_eager": True, "max_model_len": 256}
    want = outputs(LLMEngine(model_dir, EngineConfig(num_scheduler_steps=1, **settings)), prompts, params)
    got = outputs(LLMEngine(model_dir, EngineConfig(num_scheduler_steps=4, **settings)), prompts, params)
    assert got == want


def test_the_tiny_random_model_runs_multi_steps_on_the_cpu(tmp_path, monkeypatch):
    """The CUDA test's model and requests, on the CPU: its check runs here too, without the device."""
    runs = counted_runs(monkeypatch)
    model_dir = tiny_random_llama(tmp_path / "tiny")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (23, 30, 19, 30)]
    prompts = [[t % 512 for t in prompt] for prompt in PROMPTS]
    want = outputs(LLMEngine(model_dir, EngineConfig(num_scheduler_steps=1)), prompts, params)
    assert outputs(LLMEngine(model_dir, EngineConfig(num_scheduler_steps=4)), prompts, params) == want and runs


def test_a_runtime_class_with_its_own_forward_runs_it_at_every_step(small_dir, monkeypatch):
    """A family's runtime class (families/: a plugin's) that overrides forward: each of a multi-step's
    steps goes through it, as one step at a time does."""
    from optkit.models import llama, loader

    calls = []

    class Counted(llama.CausalLM):
        def forward(self, input_ids, *args, **kwargs):
            calls.append(input_ids.shape[0])
            return super().forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(loader, "_runtime_class", lambda model_type: Counted)
    params = [SamplingParams(max_tokens=12, temperature=0)]
    got = outputs(engine(small_dir, 8), PROMPTS[:1], params)
    assert len(calls) == 12  # the prefill, then 11 decode steps: 8 and 3
    assert got == outputs(LLMEngine(small_dir, EngineConfig(num_scheduler_steps=1, block_size=4)), PROMPTS[:1], params)
