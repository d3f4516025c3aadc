"""The Triton paged-attention kernels with sliding windows and soft-caps (Mistral, Gemma) against
the PyTorch reference, under the Triton interpreter on CPU and on CUDA."""

import pytest

# first: it sets TRITON_INTERPRET before triton is imported, and skips this module without triton
from tests.kernels.triton_devices import DEVICES

# isort: split

from optkit.kernels.triton import paged_attention as kernels
from tests.kernels.paged_steps import paged_attention_reference, random_step
from tests.kernels.test_triton_paged_attention import MIXED


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "softcap"), [(1, None), (5, None), (8, 0.6), (None, 0.6)])
@pytest.mark.parametrize("lens", [MIXED[0], MIXED[2], ([1, 1, 1], [40, 9, 3])])
def test_windows_and_softcaps_match_the_reference(lens, window, softcap, device):
    """Prefill tiles and decodes whose first key tiles lie wholly outside some rows' windows; small
    tiles (block_n 16) and split decodes so that windows cross tile and split boundaries."""
    import torch

    q, _, _, k_cache, v_cache, meta = random_step(*lens, 4, device=device, seed=len(lens[0]))
    q = q * 3  # scores past the soft-cap
    for num_splits in (1, 4):
        out = kernels.paged_attention(
            q, k_cache, v_cache, meta, 0.25, window=window, softcap=softcap, block_n=16, num_splits=num_splits
        )
        expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.25, window=window, softcap=softcap)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
