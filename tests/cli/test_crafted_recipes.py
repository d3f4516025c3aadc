"""Recipes and routing configs from someone else: every crafted one is refused in one short line,
exit 2, fast, whichever command reads it (`optkit run`, `optkit serve --recipe`, `--tiers`)."""

import os
import resource
import subprocess
import sys
import time

import pytest

MEMORY_CAP = 6 << 30  # bytes of address space for a subprocess that expands an alias bomb


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Relative paths (a recipe's `output: out`) land in tmp_path, were anything to run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))


def alias_bomb() -> str:
    """Under 300 bytes of YAML whose aliases to aliases stand for 9^7 strings, in a key the recipe takes
    (printed whole, as an error's "got" once did: a 30 MB line)."""
    levels = ["&a [lol,lol,lol,lol,lol,lol,lol,lol,lol]"]
    for name, previous in zip("bcdefg", "abcdef", strict=True):
        levels.append(f"&{name} [{','.join(['*' + previous] * 9)}]")
    return "model: small\noutput: out\ngate:\n  max_kld: [" + ",".join(levels) + "]\n"


def deep(levels: int) -> str:
    return "model: small\noutput: out\ngate:\n  max_kld: " + "[" * levels + "]" * levels + "\n"


def run_capped(tmp_path, *args, timeout=60) -> tuple[int, str, float]:
    """`optkit ARGS` in a subprocess under a memory cap and a timeout: (exit code, stderr, seconds)."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    env = {**os.environ, "OPTKIT_CACHE": str(tmp_path / "cache"), "COLUMNS": "80"}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "optkit.cli.main", *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            preexec_fn=cap,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"optkit {' '.join(map(str, args))} ran past {timeout} s")
    return done.returncode, done.stderr, time.perf_counter() - start


def one_short_line(err: str, limit: int = 300) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[:2000]
    assert "Traceback" not in err and len(lines[0]) <= limit, lines[0][:2000]
    return lines[0]


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(alias_bomb())
    assert len(recipe.read_bytes()) <= 340
    code, err, seconds = run_capped(tmp_path, "run", recipe)
    line = one_short_line(err)
    assert code == 2 and "aliases" in line and seconds < 30


@pytest.mark.parametrize("command", ["run", "serve", "tiers"])
def test_aliases_and_anchors_are_refused_by_every_reader(run_cli, tmp_path, command):
    file = tmp_path / "file.yaml"
    if command == "tiers":
        file.write_text("order: &o [small]\ndefault: nosuch\n")  # (read whole, a bad default: exit 2 too)
        code, _, err = run_cli("serve", "small", "--route", "tiered", "--tiers", file, "--port", "0")
    else:
        file.write_text("x: &a 1\nserve:\n  models: {small: {path: small}}\n  route: *a\n")
        code, _, err = run_cli(*(["run", file] if command == "run" else ["serve", "--recipe", file, "--port", "0"]))
    line = one_short_line(err)
    assert code == 2 and "anchors and aliases" in line and "line 1" in line


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_recipe_that_is_not_utf8_is_one_line(run_cli, tmp_path, command):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes("model: small\noutput: out\n# café\n".encode("latin-1"))
    code, _, err = run_cli(*([command, recipe] if command == "run" else [command, "--recipe", recipe]))
    line = one_short_line(err)
    assert code == 2 and "not UTF-8" in line and "0xe9" in line


@pytest.mark.parametrize("command", ["run", "serve", "tiers"])
def test_a_file_nested_5000_levels_deep_is_one_line(run_cli, tmp_path, command):
    file = tmp_path / "file.yaml"
    file.write_text(deep(5000))
    if command == "tiers":
        code, _, err = run_cli("serve", "small", "--route", "tiered", "--tiers", file, "--port", "0")
    else:
        code, _, err = run_cli(*(["run", file] if command == "run" else ["serve", "--recipe", file, "--port", "0"]))
    line = one_short_line(err)
    assert code == 2 and "nested more than" in line


def test_shallow_nesting_still_reads(tmp_path):
    from optkit.yaml_files import load_yaml

    assert load_yaml("a: " + "[" * 20 + "1" + "]" * 20) is not None


@pytest.mark.parametrize(
    "recipe",
    [
        "model: small\noutput: out\ngate:\n  max_kld: '{long}'\n",  # a value echoed as (got ...)
        "model: small\noutput: out\nquantize:\n  method: '{long}'\n",  # a value in a validator's message
        "serve:\n  models: {{small: {{path: small}}}}\n  engine: {{dtype: '{long}'}}\n",  # the engine's check
        "serve:\n  models: {{small: {{path: small}}}}\n  shadow: {{rate: '{long}'}}\n",
        "model: small\noutput: out\n? '{long}'\n: 1\n",  # an unknown key
    ],
)
def test_a_long_value_in_a_recipe_is_shortened_in_the_error(run_cli, tmp_path, recipe):
    file = tmp_path / "recipe.yaml"
    file.write_text(recipe.format(long="x\\e[31m" * 20_000))
    command = ["serve", "--recipe", file, "--port", "0"] if recipe.startswith("serve") else ["run", file]
    code, _, err = run_cli(*command)
    line = one_short_line(err, limit=700)
    assert code == 2 and "\x1b" not in line and "characters)" in line


def test_a_value_yaml_parses_but_python_refuses_is_one_line(run_cli, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: small\noutput: out\ngate:\n  max_kld: " + "1" * 5000 + "\n")
    code, _, err = run_cli("run", recipe)
    assert code == 2 and "cannot be read" in one_short_line(err)


def test_a_set_value_that_is_not_yaml_is_one_line(run_cli, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: small\noutput: out\n")
    code, _, err = run_cli("run", recipe, "--set", "gate.max_kld=[1,")
    assert code == 2 and "--set gate.max_kld" in one_short_line(err)


def test_a_recipe_larger_than_a_mebibyte_is_refused_unread(run_cli, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: small\n" + "# padding\n" * 120_000)  # (read whole, no output: exit 2 too)
    code, _, err = run_cli("run", recipe)
    assert code == 2 and "larger than 1 MiB" in one_short_line(err)


def test_a_recipe_that_is_a_list_is_refused(run_cli, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("[]\n")
    code, _, err = run_cli("run", recipe)
    assert code == 2 and "must be a mapping" in one_short_line(err)
