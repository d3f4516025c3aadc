"""Does llama.cpp load a .gguf and compute finite logits from it? (`optkit verify model.gguf` when
llama-cpp-python is installed.) Agreement with optkit's runtime is tests/compat/test_llama_cpp_column.py's."""

from pathlib import Path

import torch

from optkit.errors import OptkitError

PROBE_TOKENS = 8


def check_llama_cpp_load(path: str | Path) -> list[str]:
    """Problems, empty when llama.cpp loads the file and its logits for a few tokens are finite."""
    from optkit.gate.llama_cpp import LlamaCppModel

    try:
        model = LlamaCppModel(path, n_ctx=64)
    except OptkitError as e:
        return [f"llama.cpp does not load it: {e}"]
    try:
        ids = model.tokenize("The quick brown fox jumps over the lazy dog.")[:PROBE_TOKENS] or [0]
        logits, vocab = model(torch.tensor([ids])).logits, model.vocab_size
    finally:
        model.close()
    if logits.shape[-1] != vocab or not torch.isfinite(logits).all():
        return [f"llama.cpp loads it but its logits for {len(ids)} tokens are not finite"]
    return []
