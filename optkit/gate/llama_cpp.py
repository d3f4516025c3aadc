"""llama.cpp as the gate's artifact model: the logits of every position of a window, computed by
llama.cpp itself through llama-cpp-python (the optional extra `optkit[gguf]`), so a .gguf is judged
by the runtime that will serve it (its CPU dot products quantize activations to 8 bits)."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from optkit.errors import OptkitError

INSTALL_HINT = "pip install 'optkit[gguf]' (llama-cpp-python, built from source)"


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppModel:
    """`model(tokens).logits` as a transformers model answers it: tokens [B, T] -> logits [B, T, V]
    (float32), each row evaluated from an empty context."""

    def __init__(self, path: str | Path, n_ctx: int = 2048):
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise OptkitError(f"evaluating a .gguf runs llama.cpp: {INSTALL_HINT}") from e
        self.n_ctx = n_ctx
        try:
            self.llm = Llama(
                model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False
            )
        except (ValueError, RuntimeError) as e:
            raise OptkitError(f"llama.cpp cannot load {path} ({e}): re-create it with optkit quantize") from e

    @property
    def vocab_size(self) -> int:
        return self.llm.n_vocab()

    def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
        """llama.cpp's own token ids for `text`, special tokens in the text parsed as transformers does."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def close(self) -> None:
        """Free llama.cpp's model and context now (not in a destructor at interpreter exit)."""
        self.llm.close()

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor) -> SimpleNamespace:
        rows = []
        for row in tokens.tolist():
            if len(row) > self.n_ctx:
                raise OptkitError(f"a sequence of {len(row)} tokens exceeds llama.cpp's context of {self.n_ctx}")
            self.llm.reset()
            self.llm.eval(row)
            rows.append(torch.from_numpy(np.array(self.llm.scores[: len(row)], dtype=np.float32)))
        return SimpleNamespace(logits=torch.stack(rows))
