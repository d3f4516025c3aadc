"""EAGLE-3 heads (optkit/speculative/eagle3_model.py, distill3.py; runtime/eagle3_layer.py): the
training-time test computes what drafting computes, a trained head is served as training simulates it
(Llama and Qwen3 targets), greedy speculation with one is plain decoding, and a head of the wrong kind
or target is refused in one line."""

import json

import pytest
import torch

from optkit.errors import OptkitError
from optkit.models.config import ModelConfig
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.load import load_model
from optkit.runtime.eagle_proposer import EagleProposer
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams
from optkit.speculative.acceptance import draft_chain3
from optkit.speculative.distill3 import draft_vocabulary, residual_streams
from optkit.speculative.eagle3_model import new_eagle3_head
from optkit.speculative.eagle_head import eagle3_feature_layers
from optkit.speculative.head_files import read_head, write_head
from optkit.speculative.head_model import first_layer_embedding
from optkit.speculative.options import SpeculatorTrainOptions
from optkit.speculative.train import train_speculator
from tests.runtime.test_eagle_proposer import PROMPTS, running
from tests.tiny_families import save_tiny_family

TINY3 = dict(kind="eagle3", steps=3, batch_size=2, seq_len=32, warmup_steps=1, eval_prompts=1, eval_new_tokens=8,
             num_speculative_tokens=2, ttt_steps=3)  # fmt: skip


def untrained_head(target, vocab=512, seed=0):
    config = ModelConfig.from_hf(target.config.to_dict())
    head = new_eagle3_head(target, seed, torch.arange(0, 2 * vocab, 2), eagle3_feature_layers(config.num_hidden_layers))
    for name, weight in head.named_parameters():  # norms that count
        if "norm" in name:
            weight.data += torch.linspace(-0.5, 0.5, weight.numel())
    return head.eval()


def test_feature_layers_are_low_middle_high_and_vllms_on_deep_targets():
    assert eagle3_feature_layers(32) == (2, 16, 29)  # vLLM's (2, L//2, L-3)
    assert eagle3_feature_layers(12) == (2, 6, 9)
    assert eagle3_feature_layers(4) == (1, 2, 3)
    assert eagle3_feature_layers(2) == (1, 1, 1)


def test_draft_vocabulary_is_the_most_frequent_tokens_ascending():
    windows = torch.tensor([[5, 5, 5, 9, 9, 1, 7], [7, 7, 7, 7, 2, 2, 3]])
    assert draft_vocabulary(windows, 10, 2).tolist() == [5, 7]  # 7 five times, 5 three times
    assert draft_vocabulary(windows, 10, 3).tolist() == [2, 5, 7]  # 2 and 9 twice each: the smaller id


def test_the_training_time_test_computes_what_drafting_computes(draft_dir):
    # Step i of the unrolled training equals running the head causally over the real prefix 0..r
    # followed by its own chain of i rows: the paper's mask, the positions r+i, the fed-back h.
    target = load_model(draft_dir, dtype=torch.float32).eval()
    head = untrained_head(target)
    tokens = torch.tensor([PROMPTS[1][:12]])
    embed = first_layer_embedding(target)
    with torch.no_grad():
        fused, _ = residual_streams(target, tokens, head.feature_layers)
        rows = tokens.shape[1] - 1
        embeds = [embed(tokens[:, (torch.arange(rows) + i + 1).clamp(max=rows)]) for i in range(3)]
        unrolled = head.training_time_test(embeds, head.fc(fused[:, :-1]), 3)
        r = 5
        residuals, inputs = head.fc(fused[:, : r + 1]), embed(tokens[:, 1 : r + 2])
        for i in range(3):
            h = head(inputs, residuals, torch.arange(inputs.shape[1]))[:, -1:]
            torch.testing.assert_close(h[0, 0], unrolled[i][0, r], atol=1e-5, rtol=1e-4)
            residuals = torch.cat((residuals, h), dim=1)
            inputs = torch.cat((inputs, embed(tokens[:, r + i + 2 : r + i + 3])), dim=1)


@pytest.mark.parametrize("family", [None, "qwen3"])
def test_the_served_head_drafts_what_training_simulates(tmp_path, draft_dir, small_dir, family):
    model = draft_dir if family is None else save_tiny_family(family, tmp_path / family, small_dir)
    target = load_model(model, dtype=torch.float32).eval()
    head = untrained_head(target)
    write_head(tmp_path / "head", head, model, overwrite=False)
    prompt = [300 + 7 * i for i in range(21)]
    tokens = torch.tensor([prompt])
    embed = first_layer_embedding(target)
    with torch.no_grad():
        fused, _ = residual_streams(target, tokens, head.feature_layers)
        simulated = draft_chain3(head, embed, embed(tokens[:, 1:]), head.fc(fused[:, :-1]), 3)
    proposer = EagleProposer.load(tmp_path / "head", load_runtime_model(model), model, 64, 8, prefix_caching=True)
    assert proposer.feature_layers == head.feature_layers
    seq = running(list(prompt))
    proposer.observe(seq, 0, proposer._target_features(seq.token_ids)[:-1])
    [(served, _)] = proposer.propose([(seq, 3)])
    assert list(served) == list(simulated)
    assert all(t % 2 == 0 and t < 1024 for t in served)  # the draft vocabulary only


def test_greedy_speculation_with_a_trained_eagle3_head_is_plain_decoding(tmp_path, draft_dir, run_cli):
    result = train_speculator(draft_dir, tmp_path / "h", SpeculatorTrainOptions(**TINY3))
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["kind"] == "eagle3" and config["draft_vocab_size"] == 1024 and len(config["feature_layers"]) == 3
    assert 1.0 <= result.mean_acceptance_length <= 3.0
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLMEngine(draft_dir, EngineConfig(block_size=8, kv_cache_blocks=64)).generate(PROMPTS, params)
    spec_config = EngineConfig(
        block_size=8,
        kv_cache_blocks=12,
        max_num_seqs=4,
        speculative=f"eagle:{tmp_path / 'h'}",
        num_speculative_tokens=3,
    )  # fmt: skip  (tight: preemptions too)
    llm = LLMEngine(draft_dir, spec_config)
    assert llm.generate(PROMPTS, params) == plain
    assert llm.stats().num_spec_draft_tokens > 0
    head = llm.decoding.proposer
    assert head.block_manager.num_free_blocks == head.block_manager.num_blocks and not head._states
    # the same seed trains the same head; resumed from a checkpoint too
    train_speculator(draft_dir, tmp_path / "r", SpeculatorTrainOptions(**TINY3, checkpoint_every=1), stop_after=2)
    train_speculator(draft_dir, tmp_path / "r", SpeculatorTrainOptions(**TINY3, checkpoint_every=1), resume=True)
    assert (tmp_path / "h" / "model.safetensors").read_bytes() == (tmp_path / "r" / "model.safetensors").read_bytes()


def test_an_eagle3_head_is_refused_for_another_target_or_a_broken_config(tmp_path, draft_dir, small_dir, run_cli):
    target = load_model(draft_dir, dtype=torch.float32).eval()
    write_head(tmp_path / "h", untrained_head(target), draft_dir, overwrite=False)
    read_head(tmp_path / "h", target, draft_dir)  # its own target: fine
    code, _, err = run_cli("generate", small_dir, "Hello", "--speculative", f"eagle:{tmp_path / 'h'}")
    assert code == 2 and "trained for another model" in err and len(err.strip().splitlines()) == 1, err
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    for change, message in [({"kind": "eagle2"}, "kind"), ({"feature_layers": [-1]}, "three layers"),
                            ({"feature_layers": [1, 1, 9]}, "reach past")]:  # fmt: skip
        (tmp_path / "h" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(OptkitError, match=message):
            read_head(tmp_path / "h", target, draft_dir)
