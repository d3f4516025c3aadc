"""The C++ operator libraries are built into and loaded from this user's own cache only: a kernel
cache directory that another user owns or may write into is never built into or dlopened; the
operators then run on the PyTorch path, with a line naming the directory and what to change."""

import logging
import os
import stat

import pytest

from optkit.kernels import cpp_build


@pytest.fixture
def calls(tmp_path, monkeypatch):
    """torch's cpp_extension.load, recorded instead of run; the cache at tmp_path/cache."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_build.platform, "machine", lambda: "x86_64")
    made = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, *args, **kwargs: made.append(kwargs["build_directory"]))
    return made


def source(tmp_path):
    path = tmp_path / "ops.cpp"
    path.write_text("// a library\n")
    return path


def test_the_kernel_cache_is_created_private_whatever_the_umask(tmp_path, calls):
    previous = os.umask(0o002)
    try:
        assert cpp_build.load(source(tmp_path), "optkit_test") == ""
    finally:
        os.umask(previous)
    [built] = calls
    for path in (tmp_path / "cache" / "kernels", tmp_path / "cache" / "kernels" / os.path.basename(built)):
        assert not stat.S_IMODE(path.stat().st_mode) & 0o022, path


@pytest.mark.parametrize("part", ["kernels", "library dir", "library"])
def test_a_kernel_cache_others_may_write_is_never_built_into_or_loaded(tmp_path, calls, part, caplog):
    cpp = source(tmp_path)
    assert cpp_build.load(cpp, "optkit_test") == ""  # once, to learn the library's directory
    built = tmp_path / "cache" / "kernels" / os.path.basename(calls.pop())
    unsafe = {"kernels": built.parent, "library dir": built, "library": built / f"{built.name}.so"}[part]
    if part == "library":
        unsafe.write_bytes(b"\x7fELF")
    unsafe.chmod(stat.S_IMODE(unsafe.stat().st_mode) | stat.S_IWOTH)
    with caplog.at_level(logging.WARNING, logger="optkit.kernels.cpp_build"):
        reason = cpp_build.load(cpp, "optkit_test")
    assert calls == []  # neither built nor loaded
    assert f"C++ kernel cache {unsafe} is writable by others" in reason and f"chmod go-w {unsafe}" in reason
    assert "\n" not in reason and [r.getMessage() for r in caplog.records] == [reason]


def test_a_kernel_cache_another_user_owns_is_never_loaded(tmp_path, calls, monkeypatch):
    cpp = source(tmp_path)
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(tmp_path / "cache" / "kernels").st_uid + 1)
    reason = cpp_build.load(cpp, "optkit_test")
    assert calls == [] and "belongs to another user" in reason


def test_a_build_under_a_group_writable_umask_is_this_users_alone_and_loads_next_time(tmp_path, monkeypatch):
    """ninja's objects, its build files and the library follow the umask; under 002 a group member could
    edit an object that ninja relinks into the next library. The build runs under 022, and the umask
    is restored after it."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_build.platform, "machine", lambda: "x86_64")

    def build(name, *args, build_directory, **kwargs):  # what a build leaves, each made with mode 777 & ~umask
        for file in (f"{name}.so", "ops.o", "build.ninja", ".ninja_log"):
            with open(os.open(os.path.join(build_directory, file), os.O_CREAT | os.O_WRONLY, 0o777), "wb") as f:
                f.write(b"\x7fELF")

    monkeypatch.setattr(cpp_extension, "load", build)
    previous = os.umask(0o002)
    try:
        assert cpp_build.load(source(tmp_path), "optkit_test") == ""
        assert os.umask(0o002) == 0o002  # put back after the build
        assert cpp_build.load(source(tmp_path), "optkit_test") == ""  # the next start's check passes
    finally:
        os.umask(previous)
    [directory] = (tmp_path / "cache" / "kernels").iterdir()
    built = list(directory.iterdir())
    assert len(built) == 4 and not [f for f in built if stat.S_IMODE(f.stat().st_mode) & 0o022]


def test_an_object_file_others_may_write_is_never_relinked_or_loaded(tmp_path, calls):
    cpp = source(tmp_path)
    assert cpp_build.load(cpp, "optkit_test") == ""
    built = tmp_path / "cache" / "kernels" / os.path.basename(calls.pop())
    planted = built / "ops.o"
    planted.write_bytes(b"\x7fELF")
    planted.chmod(0o664)
    assert f"C++ kernel cache {planted} is writable by group" in cpp_build.load(cpp, "optkit_test")
    assert calls == []


def test_a_changed_header_builds_a_new_library(tmp_path, calls):
    """A header the source includes from beside it is part of the library's version: editing only the
    header must never load the library built from the old one."""
    cpp = tmp_path / "ops.cpp"
    cpp.write_text('// a library\n#include "kernels.h"\n#include <vector>\n')
    (tmp_path / "kernels.h").write_text('#pragma once\n#include "tiles.h"\n#include "kernels.h"\n')
    tiles = tmp_path / "tiles.h"
    tiles.write_text("// the tiles\n")
    cpp_build.load(cpp, "optkit_test")
    cpp_build.load(cpp, "optkit_test")
    tiles.write_text("// the tiles, changed\n")  # a header the header includes
    cpp_build.load(cpp, "optkit_test")
    first, again, changed = (os.path.basename(path) for path in calls)
    assert first == again and changed != first
