"""Nothing optkit did not write is deleted: an output, or a directory beside it that optkit works
in, is replaced only when it is empty or an optkit output nobody added to (each file listed in its
optkit.json); a symlink is never followed; no flag changes that (optkit/artifacts.py)."""

import json
from pathlib import Path

import pytest

from tests.cli.test_bad_input import assert_user_error
from tests.pipeline.test_run import write_recipe


def someones_directory(path: Path) -> Path:
    """A directory optkit did not write: a source tree."""
    path.mkdir(parents=True)
    (path / "main.py").write_text("print('precious')\n")
    (path / "src").mkdir()
    (path / "src" / "lib.py").write_text("x = 1\n")
    return path


def assert_untouched(path: Path) -> None:
    assert (path / "main.py").read_text() == "print('precious')\n"
    assert (path / "src" / "lib.py").read_text() == "x = 1\n"


def test_run_refuses_an_output_that_is_not_an_optkit_release(run_cli, tmp_path, draft_dir):
    tree = someones_directory(tmp_path / "release")
    result = run_cli("run", write_recipe(tmp_path, draft_dir))
    assert_user_error(result, str(tree), "not an optkit output", "main.py", "empty it yourself")
    assert_untouched(tree)


def test_run_refuses_a_symlinked_output(run_cli, tmp_path, draft_dir):
    tree = someones_directory(tmp_path / "elsewhere")
    (tmp_path / "release").symlink_to(tree)
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir)), "is a symlink", "release")
    assert (tmp_path / "release").is_symlink()
    assert_untouched(tree)


def test_run_never_works_through_a_symlinked_work_directory(run_cli, tmp_path, draft_dir):
    tree = someones_directory(tmp_path / "elsewhere")
    (tmp_path / ".release.work").symlink_to(tree)
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir)), ".release.work", "symlink")
    assert sorted(p.name for p in tree.iterdir()) == ["main.py", "src"]
    assert not (tmp_path / "release").exists()


def test_quantize_overwrite_refuses_a_directory_optkit_did_not_write(run_cli, tmp_path, draft_dir):
    tree = someones_directory(tmp_path / "q")
    result = run_cli("quantize", draft_dir, "--out", tree, "--overwrite")
    assert_user_error(result, str(tree), "not an optkit output", "choose another --out")
    assert_untouched(tree)


def test_quantize_overwrite_refuses_an_output_someone_added_to(run_cli, tmp_path, draft_dir):
    out = tmp_path / "q"
    assert run_cli("quantize", draft_dir, "--out", out)[0] == 0
    (out / "notes.txt").write_text("mine")
    assert_user_error(run_cli("quantize", draft_dir, "--out", out, "--overwrite"), "notes.txt", "not listed")
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("before", ["empty", "optkit output"])
def test_quantize_overwrite_replaces_an_empty_directory_or_its_own_output(run_cli, tmp_path, draft_dir, before):
    out = tmp_path / "q"
    if before == "empty":
        out.mkdir()
    else:
        assert run_cli("quantize", draft_dir, "--out", out, "--bits", "8")[0] == 0
    code, _, err = run_cli("quantize", draft_dir, "--out", out, "--overwrite")
    assert code == 0, err
    assert json.loads((out / "optkit.json").read_text())["options"]["weights"]["bits"] == 4


def test_quantize_overwrite_refuses_a_symlinked_output(run_cli, tmp_path, draft_dir):
    tree = someones_directory(tmp_path / "elsewhere")
    (tmp_path / "q").symlink_to(tree)
    assert_user_error(run_cli("quantize", draft_dir, "--out", tmp_path / "q", "--overwrite"), "is a symlink")
    assert (tmp_path / "q").is_symlink()
    assert_untouched(tree)


def test_target_kld_leaves_a_directory_beside_the_output_alone(run_cli, tmp_path, draft_dir):
    """--target-kld works in a new directory of its own (it used to clear `.NAME.repair`)."""
    beside = someones_directory(tmp_path / ".q.repair")
    result = run_cli("quantize", draft_dir, "--target-kld", "0.01", "--ignore", "*.nothing", "--out", tmp_path / "q")
    assert_user_error(result, "--ignore")
    assert_untouched(beside)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".q.repair"]


def test_target_kld_refuses_a_rejected_output_optkit_did_not_write(run_cli, tmp_path, draft_dir):
    tree = someones_directory(tmp_path / "q.rejected")
    result = run_cli("quantize", draft_dir, "--target-kld", "0.01", "--ignore", "*.nothing", "--out", tmp_path / "q")
    assert_user_error(result, str(tree), "not an optkit output")
    assert_untouched(tree)


def test_a_gguf_output_leaves_a_directory_beside_it_alone(run_cli, tmp_path, draft_dir):
    """A .gguf is staged in a new directory of its own (it used to replace and clear `.NAME.stage`)."""
    beside = someones_directory(tmp_path / ".m.gguf.stage")
    args = ("--format", "gguf", "--bits", "8", "--group-size", "32", "--out", tmp_path / "m.gguf")
    code, _, err = run_cli("quantize", draft_dir, *args)
    assert code == 0, err
    assert_untouched(beside)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.gguf.stage", "m.gguf"]


def test_repair_publishes_over_its_own_output_only(tmp_path):
    from optkit.errors import OptkitError
    from optkit.pipeline.repair import publish

    source = tmp_path / "candidate"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"x")
    tree = someones_directory(tmp_path / "repaired")
    with pytest.raises(OptkitError, match="not an optkit output"):
        publish(source, tree)
    assert_untouched(tree)


@pytest.mark.parametrize(
    "layout",
    ["unlisted file", "unlisted file in a subdirectory", "symlink to a directory", "broken manifest"],
)
def test_only_an_output_whose_every_file_is_listed_may_be_replaced(tmp_path, layout):
    from optkit.artifacts import check_replaceable
    from optkit.errors import OptkitError

    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"w")
    (out / "sub" / "a.txt").write_text("a")
    listed = {"model.safetensors": "", "sub/a.txt": ""}
    (out / "optkit.json").write_text(json.dumps({"files": listed}))
    check_replaceable(out)  # as written: may go
    if layout == "unlisted file":
        (out / "extra.txt").write_text("mine")
    elif layout == "unlisted file in a subdirectory":
        (out / "sub" / "b.txt").write_text("mine")
    elif layout == "symlink to a directory":
        someones_directory(tmp_path / "elsewhere")
        (out / "link").symlink_to(tmp_path / "elsewhere")
    else:
        (out / "optkit.json").write_text("{not json")
    with pytest.raises(OptkitError, match="empty it yourself"):
        check_replaceable(out)
