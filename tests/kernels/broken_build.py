"""A real compile of a broken C++ source, for the tests that a failed build says why and falls back."""


def failed_build_reason(monkeypatch, tmp_path, module, build) -> str:
    """Point `module.SOURCE` at a file that is not C++ (and the build cache at `tmp_path`), run `build`
    (the module's uncached build function), check the one-line reason, and make `module` report it."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(module, "SOURCE", broken)
    reason = build()
    assert reason.startswith("C++ build failed") and "\n" not in reason
    monkeypatch.setattr(module, "unavailable_reason", lambda: reason)
    return reason
