"""manifest.confined_file: a name from an artifact resolves to a regular file inside it, or is refused."""

import pytest

from optkit.errors import OptkitError
from optkit.manifest import artifact_files, confined_file


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "file").write_text("x")
    (tmp_path / "outside").write_text("y")
    return root


def test_links_are_followed_while_they_stay_inside(root):
    (root / "a" / "b" / "up").symlink_to("../../file")
    (root / "a" / "abs").symlink_to(root / "a" / "b" / "up")  # absolute, inside, through another link
    (root / "a" / "dir").symlink_to("b")
    assert confined_file(root, "a/b/up") == (root / "file").resolve()
    assert confined_file(root, "a/abs") == (root / "file").resolve()
    assert confined_file(root, "a/dir/up") == (root / "file").resolve()
    assert artifact_files(root) == ["a/abs", "a/b/up", "file"]


def test_a_missing_name_is_none(root):
    (root / "dangling").symlink_to("nothing")
    assert confined_file(root, "nope") is None
    assert confined_file(root, "file/under/a/file") is None
    assert confined_file(root, "dangling") is None
    assert artifact_files(root) == ["file"]


@pytest.mark.parametrize("link", ["../outside", "a/../../outside", "OUTSIDE_ABSOLUTE", "ROOT/../outside"])
def test_a_link_out_is_refused_even_when_it_comes_back(root, link):
    """root/x -> ../root/file would land inside, but only by passing outside: refused."""
    link = {"OUTSIDE_ABSOLUTE": str(root.parent / "outside"), "ROOT/../outside": f"{root}/../outside"}.get(link, link)
    (root / "x").symlink_to(link)
    with pytest.raises(OptkitError, match="leads outside the artifact"):
        confined_file(root, "x", "optkit.json")
    (root / "x").unlink()
    (root / "x").symlink_to("../root/file")
    with pytest.raises(OptkitError, match="leads outside the artifact"):
        confined_file(root, "x")


def test_a_link_loop_is_refused(root):
    (root / "p").symlink_to("q")
    (root / "q").symlink_to("p")
    with pytest.raises(OptkitError, match="too many levels of symlinks"):
        confined_file(root, "p")


def test_a_directory_is_no_file(root):
    with pytest.raises(OptkitError, match="not a regular file"):
        confined_file(root, "a/b")
