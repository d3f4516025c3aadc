"""What every checkpoint reader shares: the dequantization loop, and the checks that a checkpoint's
tensors fit each other and the model before any kernel reads them (an artifact is untrusted data:
a qweight with fewer rows than its scales must not reach a GPU kernel that trusts the scales)."""

from collections.abc import Callable

import torch

from optkit.errors import OptkitError, shown_shape
from optkit.weights.quantized import QuantizedWeight


def weight_only(format_name: str, activations: str | None) -> None:
    """`check`'s refusal of W8A8 for a layout that stores weights only."""
    if activations is not None:
        raise OptkitError(
            f"--format {format_name} stores weight-only quantization: W8A8 needs --format compressed-tensors"
        )


def dequantize_layers(
    tensors: dict[str, torch.Tensor],
    marker: str,
    suffixes: tuple[str, ...],
    read_layer: Callable[[str], QuantizedWeight],
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """A plain state dict: each quantized layer (found by its `marker` tensor, e.g. "qweight")
    replaced by its dequantized `weight`; every other tensor as stored."""
    prefixes = [k.removesuffix(f".{marker}") for k in tensors if k.endswith(f".{marker}")]
    state = {k: v for k, v in tensors.items() if not k.endswith(suffixes)}
    for prefix in prefixes:
        state[f"{prefix}.weight"] = read_checked(prefix, read_layer).dequantize(dtype)
    return state


def read_checked(prefix: str, read_layer: Callable[[str], QuantizedWeight]) -> QuantizedWeight:
    """read_layer(prefix), its tensors checked against each other; one OptkitError naming the layer
    and the tensor otherwise (a tensor missing, or shapes a reshape or unpacking cannot take)."""
    try:
        qw = read_layer(prefix)
    except KeyError as e:
        raise OptkitError(f"{prefix}: the checkpoint lacks {e.args[0]}: re-create the artifact") from e
    except (RuntimeError, ValueError, IndexError, TypeError) as e:  # torch's shape errors are RuntimeErrors
        reason = next(iter(str(e).splitlines()), type(e).__name__)[:200]
        raise OptkitError(f"{prefix}: its tensors do not fit together ({reason}): re-create the artifact") from e
    problem = layer_problem(qw)
    if problem:
        raise OptkitError(f"{prefix}: {problem}: re-create the artifact")
    return qw


def layer_problem(qw: QuantizedWeight) -> str:
    """What in a quantized weight's tensors disagrees ("" when nothing): q [out, in], scale and
    zero_point [out, G], G dividing in (or g_idx [in] naming groups below G)."""
    if qw.q.dim() != 2 or min(qw.q.shape) < 1:
        return f"the weight is {shown_shape(qw.q)}, not [out, in]"
    out, inp = qw.q.shape
    if qw.scale.dim() != 2 or qw.scale.shape[0] != out or qw.scale.shape[1] < 1:
        return f"the scales are {shown_shape(qw.scale)} for a weight of {out} outputs (one row of scales each)"
    groups = qw.scale.shape[1]
    if qw.zero_point.shape != qw.scale.shape:
        return f"the zero points are {shown_shape(qw.zero_point)}, the scales {shown_shape(qw.scale)}"
    if qw.g_idx is None:
        if inp % groups:
            return f"{inp} input columns are not {groups} whole groups (the scales' columns)"
    elif qw.g_idx.dim() != 1 or qw.g_idx.numel() != inp:
        return f"g_idx is {shown_shape(qw.g_idx)}, not one group per each of {inp} input columns"
    elif int(qw.g_idx.min()) < 0 or int(qw.g_idx.max()) >= groups:
        return f"g_idx names groups outside the scales' {groups}"
    return ""


def check_tensor_shapes(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    """Each tensor of `state` has the shape of the parameter or buffer of the same name in `expected`
    (a model's state dict, on the meta device: no memory): one OptkitError naming the first that does not."""
    for key, tensor in state.items():
        target = expected.get(key)
        if target is not None and tensor.shape != target.shape:
            raise OptkitError(
                f"{where}: {key} is {shown_shape(tensor)} in the checkpoint but {shown_shape(target)} by config.json: "
                "check config.json against the checkpoint"
            )
