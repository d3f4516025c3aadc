"""The trainable heads (EAGLE-1 and EAGLE-3) to and from the shared on-disk layout (eagle_head.py)."""

from pathlib import Path

import torch

from optkit.artifacts import check_output_dir, replace_dir, scratch_dir
from optkit.speculative import eagle_head
from optkit.speculative.eagle3_model import Eagle3HeadModel, new_eagle3_head
from optkit.speculative.head_model import EagleHeadModel, new_head

# A head directory keeps no optkit.json: these are the files that make it optkit's to replace.
HEAD_FILES = frozenset({eagle_head.CONFIG, eagle_head.WEIGHTS})


def write_head(out: Path, head: EagleHeadModel | Eagle3HeadModel, target_dir: Path, *, overwrite: bool) -> None:
    """Write the head for the model in `target_dir`; an `out` already there is replaced only with
    `overwrite` and only when it holds a head's files and nothing else."""
    if isinstance(head, Eagle3HeadModel):
        config = eagle_head.head_config_for(
            target_dir, kind=eagle_head.KIND3, draft_vocab_size=len(head.d2t), feature_layers=head.feature_layers
        )
    else:
        config = eagle_head.head_config_for(target_dir)
    tensors = {
        name: (t.detach().to(torch.float32) if t.is_floating_point() else t.detach()).contiguous()
        for name, t in head.state_dict().items()
    }
    check_output_dir(out, overwrite, own_files=HEAD_FILES)
    with scratch_dir(out) as scratch:
        eagle_head.save_head(scratch / "head", config, tensors)
        replace_dir(scratch / "head", out, own_files=HEAD_FILES)


def read_head(head_dir: Path, target: torch.nn.Module, target_dir: Path) -> EagleHeadModel | Eagle3HeadModel:
    """The head in `head_dir` as a module for `target` (refused, in one line, for another target)."""
    prefix = eagle_head.LAYER_PREFIX
    config = eagle_head.read_head_config(head_dir)
    if config.kind == eagle_head.KIND3:
        vocab = config.draft_vocab_size
        head = new_eagle3_head(target, 0, torch.arange(vocab), config.feature_layers)
    else:
        head = new_head(target, seed=0)
    shapes = {k.removeprefix(prefix): tuple(v.shape) for k, v in head.state_dict().items() if k.startswith(prefix)}
    stored = eagle_head.load_head(head_dir, target_dir, shapes)
    state = {"fc.weight": stored.fc_weight, **{prefix + name: t for name, t in stored.layer.items()}, **stored.output}
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return head.eval()
