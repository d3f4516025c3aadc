"""Does llama.cpp load a .gguf and compute finite logits from it? (`optkit verify model.gguf` when
llama-cpp-python is installed.) Always in a child process (gate/llama_cpp_probe.py): a file that
makes llama.cpp abort is named, not the end of optkit. Agreement with optkit's runtime is
tests/compat/test_llama_cpp_column.py's."""

from pathlib import Path

from optkit.gate.llama_cpp_probe import probe_load


def check_llama_cpp_load(path: str | Path) -> list[str]:
    """Problems, empty when llama.cpp loads the file and its logits for a few tokens are finite."""
    problem = probe_load(path, n_ctx=64)
    return [problem] if problem else []
