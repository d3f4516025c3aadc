"""Weights that exercise a block quantizer's edge cases, shared by the GGUF block tests."""

import torch

KINDS = ("random", "outlier", "constant", "zero")


def block_test_rows(kind: str, rows: int, cols: int, decades: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """[rows, cols] random rows whose scales span 10^decades[0]..10^decades[1], or with an outlier
    column and value, constant blocks and a constant row, or zero blocks and a zero row."""
    scales = torch.logspace(*decades, rows).unsqueeze(1)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scales
    if kind == "outlier":
        w[:, 5] = 40.0
        w[2, 70] = -300.0
    elif kind == "constant":
        w[:, :64] = 0.37
        w[3] = -1.25
    elif kind == "zero":
        w[:, 32:96] = 0
        w[5] = 0
    return w
