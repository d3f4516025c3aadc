"""`optkit verify` and `inspect` know each family's llama.cpp architecture (quant/formats/gguf_required.py):
a file optkit wrote checks out, the architecture's own keys and tensors are there under gguf-py's
names, and a file missing one of them is refused naming it, as llama.cpp's loader would refuse it."""

import gguf
import pytest

from optkit.errors import OptkitError
from optkit.families import gguf_architectures
from optkit.quant.formats.gguf_check import check_file
from optkit.quant.formats.gguf_inspect import summary
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.tiny_families import save_tiny_family

# family -> (llama.cpp architecture, a key and a block tensor of its own that its loader requires)
OWN = {
    "gemma2": ("gemma2", "gemma2.attn_logit_softcapping", "post_ffw_norm"),
    "gemma3_text": ("gemma3", "gemma3.rope.freq_base_swa", "attn_q_norm"),
    "gemma3": ("gemma3", "gemma3.attention.sliding_window", "post_attention_norm"),
    "phi3": ("phi3", "phi3.rope.scaling.attn_factor", "attn_qkv"),
    "olmo2": ("olmo2", "olmo2.attention.layer_norm_rms_epsilon", "post_attention_norm"),
    "granite": ("granite", "granite.logit_scale", "attn_q"),
    "mixtral": ("llama", "llama.expert_count", "ffn_gate_exps"),
    "qwen2_moe": ("qwen2moe", "qwen2moe.expert_shared_feed_forward_length", "ffn_gate_inp_shexp"),
    "qwen3_moe": ("qwen3moe", "qwen3moe.expert_feed_forward_length", "ffn_down_exps"),
}
RUNS_IN_LLAMA_CPP = {"qwen2_moe": {"mlp_only_layers": []}}  # llama.cpp's qwen2moe has no dense layer
Q8_0 = QuantizeOptions(method="rtn", format="gguf", weights=WeightScheme(bits=8, group_size=32, symmetric=True))


@pytest.fixture(scope="module")
def written(tmp_path_factory, draft_dir):
    """family -> a Q8_0 .gguf optkit wrote from its tiny model."""
    made = {}

    def write(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            model = save_tiny_family(family, root / "model", draft_dir, **RUNS_IN_LLAMA_CPP.get(family, {}))
            quantize_model(model, root / "model.gguf", Q8_0)
            made[family] = root / "model.gguf"
        return made[family]

    return write


@pytest.mark.parametrize("family", list(OWN))
def test_each_familys_file_has_the_keys_and_tensors_llama_cpp_requires_under_gguf_pys_names(written, family):
    arch, key, tensor = OWN[family]
    path = written(family)
    result = check_file(path)
    assert result.ok, result.problems
    assert result.checked == ["layout", "metadata", "tensors", "values"]
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == arch and key in reader.fields
    names = {t.name for t in reader.tensors}
    kinds = gguf.MODEL_TENSORS[next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)]
    allowed = {gguf.TENSOR_NAMES[kind].format(bid=block) for kind in kinds for block in range(2)}
    assert {name.rpartition(".")[0] for name in names} <= allowed  # the names gguf-py lets this architecture have
    assert f"blk.1.{tensor}.weight" in names
    assert summary(path)["architecture"] == arch


def _renamed(path, name: str, tmp_path):
    """A copy of the file whose key or tensor `name` has another name of the same length (its last
    letter changed): the header's layout stays, and the file lacks `name`."""
    data = path.read_bytes()
    assert data.count(name.encode()) == 1
    out = tmp_path / "missing.gguf"
    out.write_bytes(data.replace(name.encode(), name[:-1].encode() + (b"X" if name[-1] != "X" else b"Y")))
    return out


@pytest.mark.parametrize("family", list(OWN))
def test_a_file_missing_a_tensor_its_architecture_requires_is_refused_naming_it(written, tmp_path, family):
    _, _, tensor = OWN[family]
    problems = check_file(_renamed(written(family), f"blk.1.{tensor}.weight", tmp_path)).problems
    assert problems and f"blk.1.{tensor}.weight" in problems[0] and "missing tensor" in problems[0]


@pytest.mark.parametrize(
    ("family", "key"),
    [("granite", "granite.logit_scale"), ("olmo2", "olmo2.attention.layer_norm_rms_epsilon"),
     ("qwen3_moe", "qwen3moe.expert_count"), ("qwen2_moe", "qwen2moe.expert_used_count")],
)  # fmt: skip
def test_a_file_missing_a_key_its_architecture_requires_is_refused_naming_it(written, tmp_path, family, key):
    problems = check_file(_renamed(written(family), key, tmp_path)).problems
    assert problems and key in problems[0] and "missing metadata" in problems[0]


def test_every_written_architecture_is_one_gguf_py_knows():
    names = {arch.name for arch in gguf_architectures().values()}
    assert names == {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "qwen2moe", "qwen3moe"}
    assert names <= set(gguf.MODEL_ARCH_NAMES.values())


def test_a_model_llama_cpps_graph_cannot_run_is_refused_in_one_line_before_calibrating(tmp_path, draft_dir):
    model = save_tiny_family("qwen2_moe", tmp_path / "model", draft_dir)  # layer 1 is dense (mlp_only_layers)
    with pytest.raises(OptkitError, match=r"layers \[1\] have a dense MLP.*use --format compressed-tensors"):
        quantize_model(model, tmp_path / "model.gguf", Q8_0)
    assert not (tmp_path / "model.gguf").exists()
