"""A training run's checkpoint: the head, AdamW's moments, the step and the options, as data
(safetensors and JSON), replaced atomically, so that `--resume` continues exactly where it was."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from optkit.artifacts import atomic_output_dir
from optkit.errors import OptkitError

HEAD_FILE = "head.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
CHECKPOINT_FILES = frozenset({HEAD_FILE, OPTIMIZER_FILE, STATE_FILE})


def save_checkpoint(directory: Path, head: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`state`: JSON data (step, options, target digest, running estimates)."""
    names = {id(p): n for n, p in head.named_parameters()}
    moments = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            slot = optimizer.state.get(param)
            if slot:
                name = names[id(param)]
                moments[f"exp_avg.{name}"] = slot["exp_avg"]
                moments[f"exp_avg_sq.{name}"] = slot["exp_avg_sq"]
                moments[f"step.{name}"] = torch.as_tensor(slot["step"], dtype=torch.float32).reshape(1)
    with atomic_output_dir(directory, overwrite=True, what="--checkpoint-dir", own_files=CHECKPOINT_FILES) as tmp:
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp / HEAD_FILE))
        save_file({k: v.contiguous() for k, v in moments.items()}, str(tmp / OPTIMIZER_FILE))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def read_checkpoint_state(directory: Path) -> dict | None:
    """The checkpoint's JSON state, or None when `directory` holds no checkpoint."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except ValueError as e:
        raise OptkitError(f"{path} is not a training checkpoint ({e}): remove it or drop --resume") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise OptkitError(f"{path} is not a training checkpoint (no step): remove it or drop --resume")
    return state


def load_checkpoint(directory: Path, head: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Put the checkpoint's head weights and AdamW moments into `head` and `optimizer`."""
    directory = Path(directory)
    weights = load_file(str(directory / HEAD_FILE))
    missing, unexpected = head.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise OptkitError(
            f"checkpoint {directory} holds another head (missing {missing[:2]}, unexpected {unexpected[:2]}): "
            "remove it or drop --resume"
        )
    moments = load_file(str(directory / OPTIMIZER_FILE))
    for name, param in head.named_parameters():
        if f"exp_avg.{name}" not in moments:
            continue
        optimizer.state[param] = {
            "step": torch.tensor(moments[f"step.{name}"].item()),
            "exp_avg": moments[f"exp_avg.{name}"],
            "exp_avg_sq": moments[f"exp_avg_sq.{name}"],
        }
