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


def test_a_library_built_under_a_group_writable_umask_loads_in_the_next_process(tmp_path, monkeypatch):
    """The linker writes the .so with the umask's mode; the next start must not refuse optkit's own build."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_build.platform, "machine", lambda: "x86_64")

    def link(name, *args, build_directory, **kwargs):  # what the build leaves: a library of the umask's mode
        library = os.path.join(build_directory, f"{name}.so")
        with open(os.open(library, os.O_CREAT | os.O_WRONLY, 0o777), "wb") as f:
            f.write(b"\x7fELF")

    monkeypatch.setattr(cpp_extension, "load", link)
    previous = os.umask(0o002)
    try:
        assert cpp_build.load(source(tmp_path), "optkit_test") == ""
        assert cpp_build.load(source(tmp_path), "optkit_test") == ""  # the next start's check passes
    finally:
        os.umask(previous)
    [library] = (tmp_path / "cache" / "kernels").glob("*/*.so")
    assert not stat.S_IMODE(library.stat().st_mode) & 0o022
