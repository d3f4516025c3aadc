import pytest
import torch

from optkit.data.eval_sets import load_text_set
from optkit.data.packing import tokenize_stream
from optkit.errors import OptkitError
from optkit.modeldir import load_tokenizer
from optkit.quant.calibrate import (
    LayerStream,
    LayerWork,
    capture_inputs,
    run_layer,
    sequential_groups,
)
from optkit.quant.calibration_data import CalibrationOptions, calibration_data
from optkit.quant.formats.load import load_model
from optkit.quant.methods.gptq.step import capture_hessians


def test_layer_by_layer_forward_reproduces_the_model(draft_dir):
    """Streaming one layer at a time computes exactly what the whole model computes."""
    model = load_model(draft_dir)
    tokens = torch.randint(0, model.config.vocab_size, (3, 40))
    stream = LayerStream(draft_dir, torch.device("cpu"))
    hidden = stream.embed(tokens)
    rope = stream.position_embeddings(tokens.shape[1])
    with torch.inference_mode():
        for index in range(stream.num_layers):
            run_layer(
                f"layer {index}", stream.load_layer(index), hidden, rope, batch_size=2, device=torch.device("cpu")
            )
            stream.release_layer(index)
        logits = model.lm_head(model.model.norm(hidden))
        expected = model(tokens).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_embedding_in_the_stored_dtype_is_exact(draft_dir):
    stream = LayerStream(draft_dir, torch.device("cpu"))
    tokens = torch.randint(0, stream.config.vocab_size, (3, 20))
    weight = stream.reader.get("model.embed_tokens.weight").float()
    assert torch.equal(stream.embed(tokens), torch.nn.functional.embedding(tokens, weight))


def test_calibration_text_tokenized_text_by_text_gives_the_same_stream(draft_dir):
    tokenizer = load_tokenizer(draft_dir)
    texts = load_text_set("calib", flag="--calib").texts[:4]
    one_by_one = torch.cat([tokenize_stream(tokenizer, [text]) for text in texts])
    assert torch.equal(one_by_one, tokenize_stream(tokenizer, texts))


def test_released_layers_hold_no_memory(draft_dir):
    stream = LayerStream(draft_dir, torch.device("cpu"))
    stream.load_layer(0)
    stream.release_layer(0)
    assert all(p.device.type == "meta" for p in stream.decoder.parameters())


def test_true_sequential_groups(draft_dir):
    stream = LayerStream(draft_dir, torch.device("cpu"))
    assert sequential_groups(stream.decoder.layers[0]) == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]


def test_capture_stops_the_forward_once_the_group_is_seen(draft_dir):
    stream = LayerStream(draft_dir, torch.device("cpu"))
    layer = stream.load_layer(0)
    mlp_calls = []
    layer.mlp.register_forward_pre_hook(lambda *args: mlp_calls.append(1))
    hidden = torch.randn(4, 16, stream.config.hidden_size)
    work = LayerWork(
        layer, "model.layers.0", hidden, stream.position_embeddings(16), 2, torch.device("cpu"), set(), lambda *a: None
    )
    with torch.inference_mode():
        hessians = capture_hessians(work, ["self_attn.q_proj", "self_attn.v_proj"])
        inputs = capture_inputs(work, ["self_attn.q_proj", "self_attn.k_proj"], num_samples=3)
    assert mlp_calls == []  # attention inputs captured: the MLP never ran
    x = layer.input_layernorm(hidden).reshape(-1, stream.config.hidden_size)
    torch.testing.assert_close(hessians["self_attn.q_proj"], 2 * x.T @ x / x.shape[0], atol=1e-4, rtol=1e-4)
    assert hessians["self_attn.q_proj"] is hessians["self_attn.v_proj"]  # the same input: one Hessian
    assert inputs["self_attn.q_proj"].shape == (3, 16, stream.config.hidden_size)
    assert inputs["self_attn.k_proj"] is inputs["self_attn.q_proj"]


def test_calibration_sampling_is_seeded(draft_dir):
    tokenizer = load_tokenizer(draft_dir)
    options = CalibrationOptions(num_samples=5, seq_len=32)
    first, second = calibration_data(tokenizer, options), calibration_data(tokenizer, options)
    assert first.tokens.shape == (5, 32) and torch.equal(first.tokens, second.tokens)
    other = calibration_data(tokenizer, CalibrationOptions(num_samples=5, seq_len=32, seed=1))
    assert not torch.equal(first.tokens, other.tokens)


def test_calibrating_on_the_gate_set_is_refused(draft_dir):
    with pytest.raises(OptkitError, match="the gate's eval set"):
        calibration_data(load_tokenizer(draft_dir), CalibrationOptions(calib="heldout"))


def test_each_layer_is_handed_over_before_the_next_is_loaded(draft_dir, monkeypatch):
    """Results leave the pipeline layer by layer, so a caller can write them out instead of
    holding a whole model's worth of quantized weights."""
    from transformers import AutoConfig

    from optkit.quant.calibrate import calibrate_layerwise
    from optkit.quant.layer_step import layer_procedure
    from optkit.quant.methods.gptq.options import GPTQOptions
    from optkit.quant.methods.gptq.step import gptq_step
    from optkit.quant.targets import decoder_linears
    from optkit.weights.schemes import WeightScheme

    loaded = []
    load_layer = LayerStream.load_layer
    monkeypatch.setattr(LayerStream, "load_layer", lambda self, i: loaded.append(i) or load_layer(self, i))
    targets = {t.name for t in decoder_linears(AutoConfig.from_pretrained(draft_dir))}
    tokens = torch.randint(0, 100, (2, 16))
    layers = calibrate_layerwise(
        draft_dir,
        tokens,
        targets,
        layer_procedure(None, gptq_step(WeightScheme(bits=4), GPTQOptions()), None),
        device=torch.device("cpu"),
    )
    first = next(layers)
    assert loaded == [0]
    assert first.prefix == "model.layers.0" and all(n.startswith("model.layers.0.") for n in first.quantized)
    rest = list(layers)
    assert [r.prefix for r in rest] == [f"model.layers.{i}" for i in range(1, len(rest) + 1)]
    assert set(first.quantized).union(*(r.quantized for r in rest)) == targets
