"""A model_type no family supports is refused by every command in one line naming the supported
families, exit 2, before anything heavy is imported (so in well under a second)."""

import json
import subprocess
import sys

import pytest

from optkit.quant.supported import describe_families

COMMANDS = {
    "quantize": lambda m: ["quantize", m, "--out", f"{m}/out"],
    "eval": lambda m: ["eval", m, "--baseline", "small"],
    "generate": lambda m: ["generate", m, "hello"],
    "serve": lambda m: ["serve", m, "--port", "0"],
    "serve --model": lambda m: ["serve", "--model", f"x={m}", "--port", "0"],
    "inspect": lambda m: ["inspect", m],
    "verify": lambda m: ["verify", m],
    "compile": lambda m: ["compile", m],
    "bench": lambda m: ["bench", m],
    "run": lambda m: ["run", f"{m}/recipe.yaml"],
}


@pytest.fixture
def gpt2_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (tmp_path / "recipe.yaml").write_text(f"model: {tmp_path}\nquantize:\n  method: rtn\n")
    return tmp_path


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_an_unsupported_model_type_in_one_line(run_cli, gpt2_dir, command):
    code, out, err = run_cli(*COMMANDS[command](str(gpt2_dir)))
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "model_type 'gpt2' is not supported" in lines[0]
    assert "llama (llama, mistral, qwen2, qwen3)" in lines[0] and "phi3" in lines[0]


def test_the_runtime_commands_name_what_the_runtime_runs(run_cli, gpt2_dir):
    _, _, err = run_cli("generate", str(gpt2_dir), "hello")
    assert f"the optkit runtime runs {describe_families(runtime=True)}" in err


def test_a_recipe_override_of_the_model_is_checked(run_cli, gpt2_dir, small_dir):
    recipe = gpt2_dir / "ok.yaml"
    recipe.write_text(f"model: {small_dir}\nquantize:\n  method: rtn\n")
    code, _, err = run_cli("run", str(recipe), "--set", f"model={gpt2_dir}")
    assert code == 2 and "model_type 'gpt2'" in err


def test_the_refusal_imports_no_torch(gpt2_dir):
    """What keeps it under a second: torch (seconds on a busy machine) is never imported."""
    probe = (
        "import sys\n"
        "from optkit.cli.main import main\n"
        f"sys.argv = ['optkit', 'quantize', {str(gpt2_dir)!r}, '--out', {str(gpt2_dir / 'o')!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "False"], result.stderr
