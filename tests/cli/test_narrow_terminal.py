"""What people and scripts read line by line stays whole however narrow the terminal and however
long the path (make test also runs tests/cli at COLUMNS=40)."""

import pytest


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")


@pytest.fixture
def long_dir(tmp_path):
    path = tmp_path.joinpath(*["a-rather-long-directory-name"] * 4)
    path.mkdir(parents=True)
    return path


def test_paths_and_verdicts_are_never_wrapped(run_cli, narrow, long_dir, draft_dir):
    artifact = long_dir / "q"
    code, out, err = run_cli("quantize", draft_dir, "--out", artifact)
    assert code == 0, err
    assert out.startswith(f"wrote {artifact}  (rtn w4")
    code, out, _ = run_cli("verify", artifact)
    assert (code, out) == (0, f"ok {artifact}: 5 files match optkit.json\n")


def test_tables_of_names_and_numbers_keep_every_cell_whole(run_cli, narrow, long_dir, draft_dir):
    artifact = long_dir / "q"
    assert run_cli("quantize", draft_dir, "--out", artifact)[0] == 0
    code, out, _ = run_cli("inspect", artifact)
    assert code == 0 and f"artifact {artifact}\n" in out
    rows = [line for line in out.splitlines() if "model.layers.1.mlp.down_proj" in line]
    assert len(rows) == 1 and "384" in rows[0] and "e-" in rows[0], out  # name, shape and MSE on one line
