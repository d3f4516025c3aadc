"""A head trained by `optkit speculator train` drafts, when served (runtime/eagle_proposer.py), the
tokens the training's own chain simulation drafts: the same embedding scale (Gemma's √hidden,
Granite's multiplier), RoPE and attention on both sides, for each family's layer."""

import pytest
import torch

from optkit.modeldir import read_config
from optkit.models.config import ModelConfig
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.load import load_model
from optkit.runtime.eagle_layer import layer_shapes
from optkit.runtime.eagle_proposer import EagleProposer
from optkit.speculative.acceptance import draft_chain
from optkit.speculative.eagle_head import load_head
from optkit.speculative.head_files import write_head
from optkit.speculative.head_model import first_layer_embedding, new_head
from tests.runtime.test_eagle_proposer import running
from tests.tiny_families import save_tiny_family

PROMPT = [300 + 7 * i for i in range(21)]


@pytest.mark.parametrize("family", ["qwen3", "granite", "gemma2", "gemma3_text"])
def test_the_served_head_drafts_what_training_simulates(tmp_path, small_dir, family):
    model = save_tiny_family(family, tmp_path / family, small_dir)
    target = load_model(model, dtype=torch.float32).eval()
    head = new_head(target, seed=0)
    for name, weight in head.named_parameters():  # an untrained head whose norms count
        if "norm" in name:
            weight.data += torch.linspace(-0.5, 0.5, weight.numel()).view_as(weight)
    write_head(tmp_path / "head", head.eval(), model, overwrite=False)

    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        features = target.get_decoder()(tokens).last_hidden_state
        embed = first_layer_embedding(target)
        simulated = draft_chain(head, embed, target.get_output_embeddings(), embed(tokens[:, 1:]), features[:, :-1], 3)

    shapes = lambda config: layer_shapes(ModelConfig.from_hf(read_config(model)), config)  # noqa: E731
    proposer = EagleProposer(
        load_runtime_model(model), load_head(tmp_path / "head", model, shapes), 64, 8, prefix_caching=True
    )
    seq = running(list(PROMPT))
    proposer.observe(seq, 0, proposer._target_features(seq.token_ids)[:-1])
    [(served, _)] = proposer.propose([(seq, 3)])
    assert list(served) == list(simulated)
