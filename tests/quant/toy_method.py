"""A toy calibrated method, as a plug-in would write it outside optkit: one module, one
`register_method` (tests/quant/test_method_plugin.py registers it).

`toyclip` clips each weight row to `clip` × its largest magnitude, then rounds to nearest; the
calibration counts the tokens that reach each linear (its statistics) and records them."""

import torch
from pydantic import BaseModel, ConfigDict, Field

from optkit.quant.calibrate import LayerWork
from optkit.quant.layer_step import LinearQuantizer, sequential_step
from optkit.quant.methods import Flag, Method
from optkit.quant.methods.rtn.math import rtn_quantize


class ToyClipOptions(BaseModel):
    """The recipe section `quantize.toyclip`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip: float = Field(1.0, gt=0, le=1)


def token_counts(work: LayerWork, names: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(names, 0)

    def on_input(name: str, x: torch.Tensor, owner: str) -> None:
        counts[name] += x.reshape(-1, x.shape[-1]).shape[0]

    work.run_until_seen(names, on_input)
    return counts


def toyclip_step(options: ToyClipOptions, scheme):
    def quantize(work: LayerWork, name: str, weight: torch.Tensor, tokens: int):
        bound = options.clip * weight.abs().amax(dim=1, keepdim=True)
        clipped = weight.clamp(-bound, bound)
        return rtn_quantize(clipped, scheme), {"toy_tokens": tokens}, clipped

    return sequential_step(LinearQuantizer(quantize, statistics=token_counts))


TOYCLIP = Method(
    name="toyclip",
    summary="clipped round to nearest, calibrated (a test plug-in)",
    options=ToyClipOptions,
    flags=(Flag("--toy-clip", "clip", "toyclip: clip each row to this fraction of its largest magnitude.", float),),
    step=toyclip_step,
    memory=lambda options, workload: 0,
)
