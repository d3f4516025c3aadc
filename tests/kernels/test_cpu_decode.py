"""The C++ decode operators (kernels/cpu_decode.py) equal the PyTorch code they replace: attention of
one query token per sequence over the paged cache against the per-slot float64 reference (grouped
query, windows, head dims with a tail, block sizes, shuffled block tables), RMSNorm within float32
rounding, the attention from the fused projection and a 4-bit artifact's whole decode layer bit for
bit against the operators and modules they join; the model takes them where they apply and gives the
PyTorch path's logits."""

import os

import pytest
import torch
import torch.nn.functional as F

from optkit.kernels import cpu_decode
from optkit.kernels.kv_cache import allocate
from optkit.kernels.paged_attention import AttentionMetadata, fused_decode_attention, paged_attention, write_kv
from optkit.models.llama import Attention, RMSNorm, apply_rope, rope_cos_sin
from tests.kernels.broken_build import failed_build_reason
from tests.kernels.paged_steps import paged_attention_reference, random_step
from tests.models.paged import chunked_then_decode, run_paged

pytestmark = pytest.mark.skipif(bool(cpu_decode.unavailable_reason()), reason="the C++ operators do not build here")


def decode_step(context_lens, block_size, heads, dim, dtype, seed=0):
    """One decode per sequence over caches of random keys, block tables shuffled."""
    q, _, _, k_cache, v_cache, meta = random_step(
        [1] * len(context_lens), context_lens, block_size, heads, dim, dtype, seed=seed
    )
    return q, k_cache, v_cache, meta


@pytest.fixture(params=["native", "avx2"])
def isa(request, monkeypatch):
    """The CPU's instruction set, or capped to AVX2: the AVX2 attention and portable loops, as without AVX-512."""
    monkeypatch.setenv("OPTKIT_CPU_ISA", "avx2" if request.param == "avx2" else "")
    cpu_decode.avx512.cache_clear()
    yield request.param
    cpu_decode.avx512.cache_clear()


@pytest.fixture
def calls(monkeypatch):
    """The C++ attention calls made while the test runs."""
    made = []
    real = cpu_decode.decode_attention
    monkeypatch.setattr(cpu_decode, "decode_attention", lambda *a: made.append(a[0].shape) or real(*a))
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dim", [64, 40, 256])  # 40: a masked tail after two full vectors; 256: Gemma's
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("window", [None, 5, 64])
def test_decode_attention_equals_the_reference(isa, calls, dtype, heads, dim, block_size, window):
    q, k_cache, v_cache, meta = decode_step([1, 37, 16, 100, 9], block_size, heads, dim, dtype)
    got = paged_attention(q, k_cache, v_cache, meta, dim**-0.5, window=window)
    want = paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window=window)
    assert calls == [q.shape] and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_attention_takes_the_pytorch_path_where_the_operator_does_not_apply(calls):
    q, k_cache, v_cache, meta = decode_step([5, 20], 16, (4, 2), 32, torch.float32)
    want = paged_attention_reference(q, k_cache, v_cache, meta, 0.2, softcap=30.0)
    got = paged_attention(q, k_cache, v_cache, meta, 0.2, softcap=30.0)  # Gemma 2's capped scores
    strided = k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    assert torch.allclose(got, want, atol=1e-5) and calls == []
    assert torch.allclose(
        paged_attention(q, strided, v_cache, meta, 0.2), paged_attention(q, k_cache, v_cache, meta, 0.2), atol=1e-5
    )
    assert len(calls) == 1
    ((k8, v8),) = allocate(1, tuple(k_cache.shape), "int8", torch.float32, "cpu")
    k, v = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    write_kv(k, v, k8, v8, meta.slot_mapping)
    paged_attention(q, k8, v8, meta, 0.2)
    assert len(calls) == 1  # the 8-bit cache dequantizes on the PyTorch path


def test_a_block_table_outside_the_cache_is_refused():
    q, k_cache, v_cache, meta = decode_step([20], 16, (4, 2), 32, torch.float32)
    tables = torch.tensor([[0, k_cache.shape[0]]])
    with pytest.raises(RuntimeError, match="block_tables: a block outside the cache"):
        cpu_decode.decode_attention(q, k_cache, v_cache, tables.long(), torch.tensor([20]), 0.2, None)
    with pytest.raises(RuntimeError, match="lens"):
        cpu_decode.decode_attention(q, k_cache, v_cache, tables, torch.tensor([40]), 0.2, None)


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("size", [768, 100])
def test_rms_norm_equals_pytorch_within_float32_rounding(rows, size):
    x, weight = torch.randn(rows, size) * 5, torch.randn(size)
    got = cpu_decode.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(
        got, F.rms_norm(x, (size,), weight, 1e-6), atol=0, rtol=4 * torch.finfo(torch.float32).eps
    )
    assert cpu_decode.rms_norm(x, weight.bfloat16(), 1e-6) is None  # float32 x, bf16 weight: PyTorch's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "olmo2", "gemma"])  # cast before the weight, after it, 1 + weight
def test_every_rms_norm_of_the_families_takes_the_operator_and_rounds_as_pytorch(monkeypatch, dtype, kind):
    norm = RMSNorm(96, 1e-6, weight_in_float32=kind == "olmo2", offset=1.0 if kind == "gemma" else 0.0)
    norm.weight.data = torch.randn(96) * 0.3
    norm = norm.to(dtype)
    x = (torch.randn(40, 96) * 4).to(dtype)
    calls = []
    real = torch.ops.optkit_cpu.rms_norm
    monkeypatch.setattr(cpu_decode.torch.ops.optkit_cpu, "rms_norm", lambda *a: calls.append(a) or real(*a))
    got = norm(x)
    monkeypatch.setattr(cpu_decode, "enabled", lambda x: False)
    want = norm(x)
    assert len(calls) == 1 and got.dtype == want.dtype == dtype
    step = torch.finfo(dtype).eps * want.float().abs() * (4 if dtype == torch.float32 else 1)
    assert ((got.float() - want.float()).abs() <= step).all()


SPECIAL_VALUES = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.7, -88.7, 89.0, -104.0, 1e30, -1e30, 1e-40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_the_attention_of_the_families_head_dims_has_the_general_loops_bits(isa, dtype, dim):
    """The head dims of the families (64, 128, 256) take loops of their own (registers for the query
    and the output, keys four at a time); dims 8 past them, zero in q, K and V, take the general loops,
    which give the same first `dim` outputs to the bit (each lane's sum gains only + 0 · 0)."""
    q, k_cache, v_cache, meta = decode_step([1, 37, 16, 100, 9], 16, (9, 3), dim, dtype, seed=dim)
    padded = [F.pad(t, (0, 8)) for t in (q, k_cache, v_cache)]
    got = paged_attention(q, k_cache, v_cache, meta, 0.1, window=64)
    general = paged_attention(*padded, meta, 0.1, window=64)
    assert torch.equal(got, general[..., :dim])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu_tanh", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 21, 40])  # 21 x 1,537 values: the last shape below ATen's grain size
@pytest.mark.parametrize("size", [1, 31, 32, 33, 1536, 1537])  # ATen's vector loop takes chunks of 32
def test_the_decode_layers_gated_activation_has_atens_bits(isa, dtype, gelu_tanh, rows, size):
    """act(gate) * up, as the fused decode layer computes it from gate | up (one pass where ATen's
    silu would run its AVX-512 loops on one thread), equals ATen's activation then the product to the
    bit, infinities, overflowing and denormal values included, and NaN where ATen's is."""
    gate_up = torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(size)) * 8
    flat = gate_up.view(-1)
    flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(rows))[: len(SPECIAL_VALUES)]] = (
        torch.tensor(SPECIAL_VALUES)[: flat.numel()]
    )
    gate_up = gate_up.to(dtype)
    gate, up = gate_up[:, :size], gate_up[:, size:]
    want = (F.gelu(gate, approximate="tanh") if gelu_tanh else F.silu(gate)) * up
    got = torch.ops.optkit_cpu.gated_activation(gate_up, gelu_tanh, cpu_decode.avx512())
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.dtype == dtype and got.shape == (rows, size)
    assert torch.equal(got.isnan(), want.isnan())  # a NaN's payload aside (ATen's bf16 rounding sets its own)
    assert torch.equal(got.view(bits)[~want.isnan()], want.view(bits)[~want.isnan()])


def test_the_operators_run_alike_on_one_thread_and_on_two():
    q, k_cache, v_cache, meta = decode_step([3, 50, 77], 16, (8, 2), 64, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(q, k_cache, v_cache, meta, 0.125)
        torch.set_num_threads(2)
        two = paged_attention(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each head's sums run on one thread, in one order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_gives_the_pytorch_paths_logits(small_dir, monkeypatch, dtype):
    """`small` through chunked prefills and decodes: the C++ operators against the PyTorch code."""
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(small_dir, dtype=dtype)
    sequences = [list(range(3, 40)), list(range(50, 71)), list(range(7, 30))]
    steps = chunked_then_decode([len(s) for s in sequences], seed=1)
    fast = run_paged(model, sequences, steps)
    monkeypatch.setattr(cpu_decode, "enabled", lambda x: False)
    reference = run_paged(model, sequences, steps)
    tolerance = 1e-4 if dtype == torch.float32 else 0.15  # bf16: a rounding step of a hidden state, 8 layers on
    for got, want in zip(fast, reference, strict=True):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1)) or dtype == torch.bfloat16


def test_a_failed_build_says_why_and_the_model_runs_the_pytorch_code(monkeypatch, tmp_path, small_dir):
    from optkit.models.loader import load_runtime_model

    reason = failed_build_reason(monkeypatch, tmp_path, cpu_decode, cpu_decode.unavailable_reason.__wrapped__)
    assert cpu_decode.describe(torch.float32) == f"PyTorch ({reason})"
    model = load_runtime_model(small_dir)
    sequences = [list(range(3, 30))]
    steps = chunked_then_decode([len(s) for s in sequences], seed=2)
    fallback = run_paged(model, sequences, steps)
    monkeypatch.undo()
    torch.testing.assert_close(run_paged(model, sequences, steps)[0], fallback[0], atol=1e-4, rtol=0)


def head_norms(kind: str | None, dim: int, dtype: torch.dtype) -> tuple[RMSNorm, RMSNorm] | None:
    """Per-head q and k norms as Qwen 3 (`llama`) or Gemma 3 (`gemma`: 1 + weight) build them."""
    if kind is None:
        return None
    norms = []
    for _ in range(2):
        norm = RMSNorm(dim, 1e-6, offset=1.0 if kind == "gemma" else 0.0)
        norm.weight.data = torch.randn(dim) * 0.3
        norms.append(norm.to(dtype))
    return norms[0], norms[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 1)])
@pytest.mark.parametrize("norm_kind", [None, "llama", "gemma"])
@pytest.mark.parametrize("rotary", [64, 48])  # 48 of 64: partial rotary, the rest passes through
@pytest.mark.parametrize("window", [None, 20])
def test_attention_from_the_fused_projection_has_the_operators_bits(isa, dtype, heads, norm_kind, rotary, window):
    """decode_attention_qkv against the steps it joins (q/k norms, rope, write_kv, paged_attention):
    the same output and the same caches, bit for bit."""
    (q_heads, kv_heads), dim = heads, 64
    _, k_cache, v_cache, meta = decode_step([5, 37, 100], 16, heads, dim, dtype)
    qkv = torch.randn(3, (q_heads + 2 * kv_heads) * dim).to(dtype)
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, rotary, 2).float() / rotary)
    cos, sin = rope_cos_sin(torch.tensor([4, 36, 99]), inv_freq, 1.0, dtype)
    norms = head_norms(norm_kind, dim, dtype)
    fused_k, fused_v = k_cache.clone(), v_cache.clone()

    q, k, v = (t.view(3, -1, dim) for t in qkv.split((q_heads * dim, kv_heads * dim, kv_heads * dim), dim=-1))
    if norms:
        q, k = norms[0](q), norms[1](k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    want = paged_attention(q, k_cache, v_cache, meta, 0.125, window=window)

    args = tuple(n.cpu_operator_args(dtype) for n in norms) if norms else (None, None)
    kv = (fused_k, fused_v)
    step = fused_decode_attention(qkv, cos, sin, kv, meta, num_heads=q_heads, scale=0.125, window=window, softcap=None)
    got = cpu_decode.decode_attention_qkv(qkv, *args, step)
    assert torch.equal(got, want) and torch.equal(fused_k, k_cache) and torch.equal(fused_v, v_cache)


def test_the_fused_attention_refuses_a_slot_outside_the_cache():
    _, k_cache, v_cache, meta = decode_step([20], 16, (4, 2), 32, torch.float32)
    qkv, cos = torch.randn(1, 8 * 32), torch.ones(1, 1, 32)
    outside, tables, lens = torch.tensor([k_cache.shape[0] * 16]), meta.block_tables.long(), torch.tensor([20])
    with pytest.raises(RuntimeError, match="slot_mapping: a slot outside the cache"):
        step = cpu_decode.DecodeAttention(4, cos, cos, k_cache, v_cache, outside, tables, lens, 0.2, None)
        cpu_decode.decode_attention_qkv(qkv, None, None, step)


DECODING = [list(range(3, 40)), list(range(50, 71)), list(range(7, 30))]


def counted_and_equal(model, monkeypatch, operator: str, fused_paths: list[tuple[object, str]]) -> int:
    """DECODING through prefill chunks and then decodes, counting the calls of cpu_decode.`operator`;
    then again with every fused path (owner.name) returning None: every position's logits equal, not
    close. The count."""
    steps = chunked_then_decode([len(s) for s in DECODING], seed=1, max_chunk=6)  # the second halves decode
    calls = []
    real = getattr(cpu_decode, operator)
    monkeypatch.setattr(cpu_decode, operator, lambda *a: calls.append(a[0].shape) or real(*a))
    fast = run_paged(model, DECODING, steps)
    for owner, name in fused_paths:
        monkeypatch.setattr(owner, name, lambda *a: None)
    for got, want in zip(fast, run_paged(model, DECODING, steps), strict=True):
        assert torch.equal(got, want)
    return len(calls)


def stack_and_layers() -> list[tuple[object, str]]:
    """A 4-bit artifact's fused decode paths: the whole stack in one call, and each layer in one."""
    from optkit.models import fused_stack
    from optkit.models.llama import DecoderLayer

    return [(fused_stack, "decode"), (DecoderLayer, "decode_in_one_call")]


def w4_artifact(family: str, tmp_path, small_dir, head: str = "auto"):
    """A 4-bit RTN artifact (groups of 32) of the family's tiny model: its linears take the W4A8 kernel
    (and its head, with head="int4")."""
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme
    from tests.tiny_families import save_tiny_family

    options = QuantizeOptions(method="rtn", weights=WeightScheme(bits=4, group_size=32), head=head)
    quantize_model(save_tiny_family(family, tmp_path / family, small_dir), tmp_path / "w4", options)
    return tmp_path / "w4"


@pytest.mark.parametrize(
    "family, fused",
    [("llama", True), ("qwen3", True), ("gemma3_text", True), ("phi3", True), ("granite", True),
     ("olmo2", False), ("gemma2", False)],  # olmo2: q/k norms over all heads; gemma2: soft-capped scores
)  # fmt: skip
def test_a_models_decode_steps_take_the_fused_attention_with_the_same_logits(
    tmp_path, small_dir, monkeypatch, family, fused
):
    """Decode steps of each family's tiny model through the fused attention where it applies."""
    from optkit.models.loader import load_runtime_model
    from tests.tiny_families import save_tiny_family

    model = load_runtime_model(save_tiny_family(family, tmp_path / family, small_dir))
    fused_path = [(Attention, "decode_from_qkv")]
    assert bool(counted_and_equal(model, monkeypatch, "decode_attention_qkv", fused_path)) == fused


@pytest.mark.parametrize(
    "family, fused",
    [("llama", True), ("qwen3", True), ("gemma3_text", True),  # pre-norms, q/k norms, sandwich norms
     ("olmo2", False), ("granite", False), ("phi3", False)],  # post-norms, residual multiplier, Phi-3's MLP
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_4bit_artifacts_decode_stack_runs_in_one_call_with_the_same_logits(
    tmp_path, small_dir, monkeypatch, family, fused, dtype
):
    """A decode step's decoder layers of a W4A8 artifact in one C++ call where they apply, with the
    module path's logits; with that call off, each layer in one call, with them too."""
    from optkit.models import fused_stack
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(w4_artifact(family, tmp_path, small_dir), dtype=dtype)
    assert bool(counted_and_equal(model, monkeypatch, "decode_stack_w4a8", stack_and_layers())) == fused
    monkeypatch.undo()
    monkeypatch.setattr(fused_stack, "decode", lambda *a: None)
    assert bool(counted_and_equal(model, monkeypatch, "decode_layer_w4a8", stack_and_layers()[1:])) == fused


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # pre-norms and SiLU; sandwich norms and GELU
@pytest.mark.parametrize("batch, threads", [(1, 2), (4, 2), (5, 2), (1, 1), (1, "more than the CPUs")])
def test_the_stack_in_one_parallel_region_gives_the_regions_bits(tmp_path, small_dir, family, batch, threads):
    """A decode step of up to 4 sequences on 2 or more threads runs the whole stack in one parallel
    region, its threads meeting at spin barriers; its logits equal (not close) those of one region
    per operator. More sequences, one thread, or more threads than CPUs take the regions' path."""
    from optkit.models.loader import load_runtime_model

    cpus = len(os.sched_getaffinity(0))
    threads = cpus + 1 if threads == "more than the CPUs" else threads
    model = load_runtime_model(w4_artifact(family, tmp_path, small_dir))
    sequences = [list(range(3 + i, 27 + i)) for i in range(batch)]
    steps = [[(i, 12) for i in range(batch)]] + [[(i, 1) for i in range(batch)]] * 12  # then 12 decodes of all
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        before = cpu_decode.one_region_steps()
        one_region = run_paged(model, sequences, steps)
        ran = cpu_decode.one_region_steps() - before
        previous = cpu_decode.stack_in_one_region(False)
        try:
            regions = run_paged(model, sequences, steps)
        finally:
            cpu_decode.stack_in_one_region(previous)
    finally:
        torch.set_num_threads(threads_before)
    assert ran == (12 if batch <= 4 and 1 < threads <= cpus else 0)
    assert cpu_decode.one_region_steps() - before == ran  # none while set off
    for got, want in zip(one_region, regions, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("hooked", ["a linear", "a layer"])
def test_a_hooked_model_runs_its_hooked_layer_module_by_module(tmp_path, small_dir, hooked):
    """A forward hook on a layer, or on a part of one, sees its call at every step, the decodes
    included: the stack then runs layer by layer and the hooked layer module by module."""
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(w4_artifact("llama", tmp_path, small_dir))
    steps = chunked_then_decode([17], seed=1, max_chunk=6)
    run_paged(model, [list(range(3, 20))], steps)  # the stack gathers its weights for the fused call
    seen = []
    module = model.model.layers[1] if hooked == "a layer" else model.model.layers[0].mlp.down_proj
    module.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    run_paged(model, [list(range(3, 20))], steps)
    assert len(seen) == len(steps)


@pytest.mark.parametrize(
    "change", ["norm in place", "packed scales in place", "norm .data", "linear replaced", "layer replaced"]
)
def test_the_fused_stack_follows_a_change_of_its_weights(tmp_path, small_dir, monkeypatch, change):
    """The weights the fused stack gathered once are gathered again when the model changes under it,
    as the module path sees the change: in place, by assignment or by a module put in another's place."""
    import copy

    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(w4_artifact("llama", tmp_path, small_dir))
    steps = chunked_then_decode([len(s) for s in DECODING], seed=1, max_chunk=6)
    before = run_paged(model, DECODING, steps)  # the layers gather their weights for the fused call
    layer = model.model.layers[1]
    with torch.no_grad():
        if change == "norm in place":
            layer.post_attention_layernorm.weight.mul_(1.5)
        elif change == "packed scales in place":
            layer.mlp.down_proj.scale.mul_(2)
        elif change == "norm .data":
            layer.input_layernorm.weight.data = layer.input_layernorm.weight.data * 0.5
        elif change == "linear replaced":
            layer.self_attn.o_proj = copy.deepcopy(model.model.layers[0].self_attn.o_proj)
        else:
            model.model.layers[1] = copy.deepcopy(model.model.layers[0])
    assert counted_and_equal(model, monkeypatch, "decode_stack_w4a8", stack_and_layers())
    assert not torch.equal(run_paged(model, DECODING, steps)[-1], before[-1])  # the change moved the logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_a_verification_chunks_rows_get_the_bits_of_one_decode_each(calls, dtype, window):
    """Speculative decoding's short chunks (1 + k tokens of a sequence) on the CPU: each query row's
    output equals, bit for bit, that position decoded alone (a plain decode step), beside decodes and a
    long chunk in the same step."""
    query_lens, context_lens = [4, 1, 3, 40, 4], [11, 9, 30, 50, 17]  # 40: over the short chunks' 32
    q, _, _, k_cache, v_cache, meta = random_step(query_lens, context_lens, 8, (4, 2), 32, dtype, seed=3)
    out = paged_attention(q, k_cache, v_cache, meta, 0.3, window=window)
    assert calls  # the C++ kernel ran
    tables = [meta.block_tables[b].tolist() for b in range(len(query_lens))]
    row = 0
    for b, (n, context) in enumerate(zip(query_lens, context_lens, strict=True)):
        for i in range(n):
            if 1 < n <= 32:  # a short chunk's row: the decode of position context - n + i
                position = context - n + i
                slot = tables[b][position // 8] * 8 + position % 8
                alone = AttentionMetadata.build([1], [position + 1], [tables[b]], [slot])
                want = paged_attention(q[row : row + 1], k_cache, v_cache, alone, 0.3, window=window)
                assert torch.equal(out[row : row + 1], want), (b, i)
            row += 1
