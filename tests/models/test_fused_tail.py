"""A 4-bit artifact's decode step from its tokens to its logits in one C++ call (models/fused_tail.py,
cpu_decode.decode_token_w4a8): the logits of every multi-step decode equal, bit for bit, those of the
embedding, the stack, the norm and the head called one by one; where the call cannot compute what
the modules would (a head that is not W4A8, a hook, a change of a weight), the modules run."""

import pytest
import torch

from optkit.kernels import cpu_decode
from optkit.models import fused_tail
from optkit.runtime import multi_step
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams
from tests.kernels.test_cpu_decode import w4_artifact

PROMPTS = [list(range(5, 30)), list(range(100, 107)), list(range(300, 341)), [7, 8, 9], list(range(40, 52))]

pytestmark = pytest.mark.skipif(bool(cpu_decode.unavailable_reason()), reason="the C++ operators do not build here")


def decode_logits(model_dir, monkeypatch, batch: int, dtype: str = "float32", change=None) -> tuple[list, int]:
    """Every multi-step decode's logits [B, vocab] of `batch` greedy requests, and how many steps ran
    in one call; `change(model)` runs after the first request's first engine steps."""
    logits, calls = [], []
    real_choose, real_token = multi_step.DecodeStepTokens.__call__, cpu_decode.decode_token_w4a8
    monkeypatch.setattr(
        multi_step.DecodeStepTokens, "__call__", lambda s, x, i: logits.append(x.clone()) or real_choose(s, x, i)
    )
    monkeypatch.setattr(cpu_decode, "decode_token_w4a8", lambda *a: calls.append(1) or real_token(*a))
    engine = LLMEngine(model_dir, EngineConfig(num_scheduler_steps=6, block_size=4, max_model_len=128, dtype=dtype))
    for i, prompt in enumerate(PROMPTS[:batch]):
        engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0), f"r{i}")
    for _ in range(3):
        engine.step()
    if change is not None:
        with torch.no_grad():
            change(engine.model)
    while engine.has_unfinished():
        engine.step()
    monkeypatch.undo()
    return logits, len(calls)


def same_logits_as_the_modules(model_dir, monkeypatch, batch, dtype="float32", change=None) -> int:
    """decode_logits with the one call and with it off: equal, not close. How many steps took the call."""
    fast, calls = decode_logits(model_dir, monkeypatch, batch, dtype, change)
    monkeypatch.setattr(fused_tail, "tail", lambda *a: None)
    slow, none = decode_logits(model_dir, monkeypatch, batch, dtype, change)
    assert none == 0 and len(fast) == len(slow) > 0
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # Gemma 3: its embedding scaled, (1 + w) norms
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 5])  # 5: over the stack's one parallel region
def test_a_decode_step_runs_from_its_tokens_to_its_logits_in_one_call(
    tmp_path, small_dir, monkeypatch, family, dtype, batch
):
    model_dir = w4_artifact(family, tmp_path, small_dir, head="int4")
    assert same_logits_as_the_modules(model_dir, monkeypatch, batch, dtype) >= 12


def plain_head(model) -> torch.nn.Linear:
    """A float32 head of random weights (the same in every run), in the 4-bit head's place."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.05)
    return head


def hook_the_norm(model):
    model.model.norm.register_forward_hook(lambda module, args, out: None)


@pytest.mark.parametrize(
    "head, change, taken",
    [("full", None, False),  # the head is not a W4A8 layer: the modules compute it
     ("int4", hook_the_norm, "until the hook"),  # a hook sees every later step's call
     ("int4", lambda model: model.lm_head.scale.mul_(2), True),  # gathered again, the new scales in
     ("int4", lambda model: model.model.embed_tokens.weight.mul_(0.5), True),
     ("int4", lambda model: setattr(model, "lm_head", plain_head(model)), "until the change")],
)  # fmt: skip
def test_the_one_call_computes_what_the_modules_would_or_leaves_it_to_them(
    tmp_path, small_dir, monkeypatch, head, change, taken
):
    model_dir = w4_artifact("llama", tmp_path, small_dir, head=head)
    calls = same_logits_as_the_modules(model_dir, monkeypatch, 1, change=change)
    # 19 decodes after the prefill: three multi-steps of 6, then one step alone; the change comes after two
    assert calls == {False: 0, True: 18, "until the hook": 12, "until the change": 12}[taken]
