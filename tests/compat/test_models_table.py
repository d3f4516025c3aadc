"""bench/models_table.py renders docs/models.md from the compatibility tests' recorded cells."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _render():
    spec = importlib.util.spec_from_file_location("models_table", ROOT / "bench" / "models_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render


def _cell(row, method, kind, loader, status):
    versions = {"transformers": "5.24.0", "torch": "2.13.0"}
    return dict(row=row, method=method, kind=kind, loader=loader, status=status, versions=versions)


def test_one_row_per_family_model_type_and_one_column_per_method_and_artifact():
    cells = [
        _cell("phi3 (tiny, random)", "gptq", "gptq w4 sym", "optkit runtime", "loads"),
        _cell("phi3 (tiny, random)", "gptq", "gptq w4 sym", "vLLM", "by spec"),
        _cell("phi3 (tiny, random)", "rtn", "compressed-tensors w4 asym", "optkit runtime", "loads"),
        _cell(
            "phi3 (tiny, random)", "rtn", "compressed-tensors w4 asym", "transformers (+ compressed-tensors)", "fails"
        ),
        _cell("qwen2 (tiny, random)", "gptq", "gptq w4 sym", "optkit runtime", "loads"),
        _cell("draft (llama, trained)", "gptq", "gptq w4 sym", "optkit runtime", "loads"),  # not a family row
    ]
    text = _render()(cells)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| family | model_type | runtime | gptq<br>gptq w4 sym | rtn<br>compressed-tensors w4 asym |"
    assert rows[1] == "| llama | qwen2 | ✔ | runtime ✔ | untested |"
    assert rows[2] == "| phi3 | phi3 | ✔ | runtime ✔ · vLLM spec | runtime ✔ · transformers ✘ |"
    assert "draft" not in text
