"""Where ggml's AMX kernels fault, llama.cpp is loaded without its extra buffer types."""

import pytest

from optkit.gate import llama_cpp_buffers


@pytest.mark.parametrize(
    ("env", "amx", "wanted"), [(None, False, True), (None, True, False), ("1", True, True), ("0", False, False)]
)
def test_the_extra_buffer_types_are_dropped_on_amx_cpus_unless_told(monkeypatch, env, amx, wanted):
    if env is None:
        monkeypatch.delenv("OPTKIT_LLAMA_CPP_EXTRA_BUFTS", raising=False)
    else:
        monkeypatch.setenv("OPTKIT_LLAMA_CPP_EXTRA_BUFTS", env)
    monkeypatch.setattr(llama_cpp_buffers, "cpu_has_amx", lambda: amx)
    assert llama_cpp_buffers.extra_buffer_types_wanted() is wanted
