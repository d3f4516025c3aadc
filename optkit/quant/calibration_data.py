"""What calibration reads: its options (the recipe's `calibration` keys) and the seeded windows of
calibration text it draws."""

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from optkit.data.eval_sets import TextSet, load_text_set
from optkit.data.packing import tokenize_stream
from optkit.errors import OptkitError
from optkit.quant.moe import MOE_CALIBRATION

GATE_EVAL_SETS = ("heldout",)


class CalibrationOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    calib: str = "calib"  # bundled set name or a local .txt/.jsonl/.parquet/datasets dir
    num_samples: int = 128
    seq_len: int = 256
    seed: int = 0
    batch_size: int = 1  # samples per forward pass (as GPTQ's reference): the smallest working memory
    # mixture-of-experts models (quant/moe.py): every token through every expert ("all") for the
    # statistics, or only the routed ones; an expert whose statistics come from fewer tokens than
    # moe_min_tokens (default 2 × its input width) is quantized with RTN, with a warning
    moe_calibration: str = "all"
    moe_min_tokens: int | None = None

    @field_validator("moe_calibration")
    @classmethod
    def _known_moe_calibration(cls, value: str) -> str:
        if value not in MOE_CALIBRATION:
            raise ValueError(f"choose one of {', '.join(MOE_CALIBRATION)}, not {value!r}")
        return value


@dataclass
class CalibrationData:
    tokens: torch.Tensor  # [num_samples, seq_len]
    source: TextSet


def calibration_data(tokenizer, options: CalibrationOptions) -> CalibrationData:
    """`num_samples` windows of `seq_len` tokens at seeded random offsets of the token stream."""
    if options.calib in GATE_EVAL_SETS:
        raise OptkitError(f"--calib {options.calib} is the gate's eval set: calibrate on 'calib' or your own data")
    if options.num_samples < 1 or options.seq_len < 2:
        raise OptkitError("--num-samples must be at least 1 and --seq-len at least 2")
    source = load_text_set(options.calib, flag="--calib")
    # One text at a time (the same ids as all at once): the tokenizer's working memory, several
    # times the ids, is then that of the longest text rather than of the whole set.
    stream = torch.cat([tokenize_stream(tokenizer, [text]) for text in source.texts])
    if stream.numel() < options.seq_len:
        raise OptkitError(
            f"calibration data {options.calib!r} has {stream.numel()} tokens, fewer than "
            f"--seq-len {options.seq_len}: give more text or a smaller --seq-len"
        )
    generator = torch.Generator().manual_seed(options.seed)
    starts = torch.randint(0, stream.numel() - options.seq_len + 1, (options.num_samples,), generator=generator)
    return CalibrationData(torch.stack([stream[s : s + options.seq_len] for s in starts.tolist()]), source)
