"""Code books of non-uniform 4-bit and 8-bit weights: NF4 (QLoRA) and bitsandbytes' dynamic map.

NF4, the 4-bit NormalFloat of Dettmers et al., 2023 (QLoRA, arXiv:2305.14314): 16 values, quantiles of
N(0, 1) with equal probability mass per bin, normalized to [-1, 1], with an exact 0. The values are
bitsandbytes' own table, copied digit for digit from bitsandbytes/functional.py `get_4bit_type("nf4")`
(bitsandbytes-foundation/bitsandbytes; release 0.50.2, functional.py lines 788-805), so a checkpoint
optkit writes dequantizes to the same numbers in bitsandbytes, transformers and vLLM.

DYNAMIC: bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map(signed=True)`, functional.py lines
296-348 of 0.50.2), the code book double quantization stores NF4's block scales in.
"""

import functools

import torch

NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


@functools.cache
def nf4_code(device: str = "cpu") -> torch.Tensor:
    """The 16 NF4 values, float32, sorted (index i is the 4-bit code i)."""
    return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)


@functools.cache
def dynamic_code(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' signed dynamic map: 256 float32 values in [-1, 1], sorted. Per exponent i, the
    means of `2^(i + 7 - max_exponent_bits) + 1` evenly spaced points in [0.1, 1], scaled by 10^(i - 6)
    and mirrored; then 0 and 1 (the construction of `create_dynamic_map`, kept step for step so the
    float32 values are the same)."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def nearest_code(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest value of the sorted `code` for each x in [-1, 1] (ties go up, as
    bitsandbytes' `torch.bucketize` on the midpoints does): uint8, x's shape."""
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(x.float(), midpoints.to(x.device)).to(torch.uint8)
