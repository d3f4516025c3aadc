"""The Triton paged-attention kernels against the PyTorch references: on CPU under the Triton
interpreter (TRITON_INTERPRET=1, set by triton_devices when there is no GPU), and on CUDA."""

import pytest
import torch

# first: it sets TRITON_INTERPRET before triton is imported, and skips this module without triton
from tests.kernels.triton_devices import DEVICES

# isort: split

import optkit.kernels.triton as triton_kernels
from optkit.kernels import paged_attention as reference
from optkit.kernels.paged_attention import AttentionMetadata
from optkit.kernels.triton import paged_attention as kernels
from tests.kernels.paged_steps import paged_attention_reference, random_step, torch_write_kv


def check(q, k_cache, v_cache, meta, scale=0.25, atol=2e-5, **overrides):
    out = kernels.paged_attention(q, k_cache, v_cache, meta, scale, **overrides)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, atol=atol, rtol=atol)


MIXED = [
    # (query_lens, context_lens): decodes, fresh prefills, chunks after cached prefixes, in any order
    ([1, 9, 5, 1, 1, 2], [13, 9, 20, 1, 33, 7]),
    ([7, 1, 1, 1], [30, 4, 17, 16]),
    ([12, 3], [12, 40]),
    ([1], [1]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("lens", MIXED)
def test_mixed_prefill_and_decode_batches(lens, block_size, device):
    q, _, _, k_cache, v_cache, meta = random_step(*lens, block_size, device=device, seed=block_size)
    check(q, k_cache, v_cache, meta)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])  # MHA, a group of 3, all heads on one KV head
@pytest.mark.parametrize("dim", [16, 24])  # 24 is padded to 32
def test_head_layouts(heads, dim, device):
    q, _, _, k_cache, v_cache, meta = random_step([1, 6, 1, 3], [9, 6, 30, 21], 4, heads, dim, device=device)
    check(q, k_cache, v_cache, meta)
    decode = random_step([1, 1, 1], [9, 1, 40], 4, heads, dim, device=device)
    check(decode[0], decode[3], decode[4], decode[5])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 4, 8])  # 8 splits of 5 tiles: some splits get none
@pytest.mark.parametrize("block_size", [4, 16])
def test_split_context_decode(num_splits, block_size, device):
    q, _, _, k_cache, v_cache, meta = random_step([1, 1, 1, 1], [5, 70, 16, 33], block_size, device=device, seed=3)
    check(q, k_cache, v_cache, meta, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_matches_one_prefill(device):
    """A sequence run as chunks after its cached prefix, then decodes, equals its single prefill."""
    block_size, length = 4, 30
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, h, 16, generator=gen).to(device) for h in (8, 2, 2))
    table = torch.randperm(8, generator=gen).tolist()

    def run(pieces):
        k_cache, v_cache = (torch.zeros(8, block_size, 2, 16, device=device) for _ in range(2))
        outs, done = [], 0
        for n in pieces:
            slots = [table[t // block_size] * block_size + t % block_size for t in range(done, done + n)]
            meta = AttentionMetadata.build([n], [done + n], [table], slots, device)
            rows = slice(done, done + n)
            kernels.write_kv(k[rows], v[rows], k_cache, v_cache, meta.slot_mapping)
            outs.append(kernels.paged_attention(q[rows], k_cache, v_cache, meta, 0.25, block_n=16))
            done += n
        return torch.cat(outs)

    torch.testing.assert_close(run([11, 7, 1, 1, 5, 1, 1, 1, 1, 1]), run([length]), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    q, _, _, k_cache, v_cache, meta = random_step([1, 5, 1], [7, 12, 40], 4, dtype=dtype, device=device)
    out = kernels.paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert out.dtype == dtype
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_reference_and_skips_negative_slots(dtype, device):
    _, k, v, k_cache, v_cache, meta = random_step([3, 1, 2], [6, 9, 2], 4, dtype=dtype, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    k_cache.zero_(), v_cache.zero_()
    torch_write_kv(k, v, expected_k.zero_(), expected_v.zero_(), meta.slot_mapping)
    kernels.write_kv(k.float(), v.float(), k_cache, v_cache, meta.slot_mapping)  # cast on the way in
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    padded = torch.cat([meta.slot_mapping, torch.tensor([-1], device=device)])
    ones = torch.ones(6, 2, 16, device=device)
    kernels.write_kv(ones, ones, k_cache, v_cache, padded[1:])
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping[1:]], torch.ones(5, 2, 16, dtype=dtype, device=device))
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping[0]], expected_k.flatten(0, 1)[meta.slot_mapping[0]])


@pytest.mark.parametrize("device", DEVICES)
def test_the_wrappers_dispatch_to_triton(monkeypatch, device):
    """On CUDA (on CPU: with `use_triton` patched true), optkit.kernels.paged_attention runs these kernels,
    and layouts they do not take stay on the PyTorch path."""
    if device == "cpu":
        monkeypatch.setattr(triton_kernels, "use_triton", lambda t: True)
    q, k, v, k_cache, v_cache, meta = random_step([1, 4], [9, 4], 4, device=device)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.25)
    calls = []
    for name in ("paged_attention", "write_kv"):
        real = getattr(kernels, name)
        spy = lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(kernels, name, spy)
    reference.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = reference.paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert calls == ["write_kv", "paged_attention"]
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    calls.clear()
    strided = k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    out = reference.paged_attention(q, strided, v_cache, meta, 0.25)
    assert calls == [] and torch.allclose(out, expected, atol=1e-5)
