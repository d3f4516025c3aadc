"""The runtimes outside optkit that a checkpoint format may name (`CheckpointFormat.runtime`), as
the gate runs them: a model over a single-file artifact, input_ids [B, S] -> .logits, closed after."""

from pathlib import Path

from optkit.errors import OptkitError
from optkit.quant.formats import CheckpointFormat

MAX_CONTEXT = 2048  # tokens: the windows and the task's questions fit, a model's whole context need not


def _llama_cpp(path: Path, n_ctx: int):
    from optkit.gate.llama_cpp import LlamaCppModel

    return LlamaCppModel(path, n_ctx=n_ctx)


RUNTIMES = {"llama.cpp": _llama_cpp}


def outside_model(fmt: CheckpointFormat, path: Path, seq_len: int):
    """The format's runtime over the file `path`, with a context long enough for `seq_len`."""
    if fmt.runtime not in RUNTIMES:
        raise OptkitError(
            f"{path}: the gate runs a {fmt.NAME} file in its runtime ({fmt.runtime}), and knows only "
            f"{', '.join(RUNTIMES)}: evaluate an artifact directory"
        )
    context = fmt.file_config(path)["max_position_embeddings"] or MAX_CONTEXT
    return RUNTIMES[fmt.runtime](path, max(seq_len, min(context, MAX_CONTEXT)))
