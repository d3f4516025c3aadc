import json

import pytest

from optkit.artifacts import atomic_output_dir, content_sha256
from optkit.errors import OptkitError
from tests.conftest import leftovers


def old_output(out):
    """An earlier optkit output at `out`: one file, listed in its optkit.json."""
    out.mkdir()
    (out / "old").write_text("old")
    (out / "optkit.json").write_text(json.dumps({"files": {"old": "0" * 64}}))


def test_complete_block_renames_into_place(tmp_path):
    with atomic_output_dir(tmp_path / "a", overwrite=False) as tmp:
        (tmp / "f").write_text("1")
        assert not (tmp_path / "a").exists()
    assert (tmp_path / "a" / "f").read_text() == "1"
    assert leftovers(tmp_path, "a") == [tmp_path / "a"]


def test_failed_block_leaves_nothing_and_keeps_the_old_output(tmp_path):
    out = tmp_path / "a"
    old_output(out)
    with pytest.raises(RuntimeError), atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
        raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == ["old", "optkit.json"]
    assert leftovers(tmp_path, "a") == [out]


def test_overwrite_replaces(tmp_path):
    out = tmp_path / "a"
    old_output(out)
    with pytest.raises(OptkitError, match="--overwrite"), atomic_output_dir(out, overwrite=False):
        pass
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new"]
    assert leftovers(tmp_path, "a") == [out]


def test_directory_hash_sees_names_and_contents(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("1")
    first = content_sha256(tmp_path / "d")
    (tmp_path / "d" / "x").rename(tmp_path / "d" / "y")
    assert content_sha256(tmp_path / "d") != first
