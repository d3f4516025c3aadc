"""Windows of a token stream that a calibration run did not read: data to judge an artifact on
that neither its calibration nor the gate's eval set has seen (per-layer attribution)."""

import torch

from optkit.errors import OptkitError


def sampled_starts(num_tokens: int, seq_len: int, num_samples: int, seed: int) -> torch.Tensor:
    """The start of each of `num_samples` windows of `seq_len` tokens drawn at seeded random offsets
    of a stream of `num_tokens`: the draw `quant/calibration_data.calibration_data` makes (a test holds
    the two to the same windows)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_tokens - seq_len + 1, (num_samples,), generator=generator)


def uncovered_windows(
    stream: torch.Tensor, taken: torch.Tensor, taken_len: int, seq_len: int, count: int, *, name: str = "calib"
) -> torch.Tensor:
    """Up to `count` windows of `seq_len` tokens ([n, seq_len]) of `stream` that share no token with
    the windows of `taken_len` starting at `taken`, spread evenly over the stream."""
    covered = torch.zeros(stream.numel() + 1, dtype=torch.int64)
    for start in taken.tolist():  # +1 at each start, -1 past each end: a running sum marks coverage
        covered[start] += 1
        covered[min(start + taken_len, stream.numel())] -= 1
    free = (covered.cumsum(0)[: stream.numel()] == 0).to(torch.int64)
    # free tokens in [s, s + seq_len) for every aligned s: a whole window is free when it is seq_len
    run = torch.cat([torch.zeros(1, dtype=torch.int64), free.cumsum(0)])
    starts = torch.arange(0, stream.numel() - seq_len + 1, seq_len)
    usable = starts[(run[starts + seq_len] - run[starts]) == seq_len]
    if usable.numel() == 0:
        raise OptkitError(
            f"calibration read every window of {seq_len} tokens of {name!r}: attribute with a smaller --seq-len "
            "or calibrate on fewer --num-samples"
        )
    pick = torch.linspace(0, usable.numel() - 1, min(count, usable.numel())).round().long().unique()
    return torch.stack([stream[s : s + seq_len] for s in usable[pick].tolist()])
