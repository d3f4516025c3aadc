"""`optkit verify`: recheck an artifact against its manifest."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, console, print_json, require_supported
from optkit.text_safety import rich_text


def verify(
    artifact: Annotated[str, typer.Argument(help="Artifact directory written by optkit, or a .gguf file.")],
    load: Annotated[
        str | None,
        typer.Option(
            help="Also load it in this loader: transformers (compares logits with optkit's runtime); "
            "llama.cpp for a .gguf (the default when llama-cpp-python is installed)."
        ),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Recheck the sha256 of every file listed in optkit.json; exit 1 naming any that differ.
    With --load transformers, also exit 1 when transformers loads it with missing, unexpected or
    re-initialised keys, or with logits beyond tolerance of optkit's runtime.
    A release's vllm.yaml (recipe `deploy:`) must be what its artifact needs (exit 1 naming the key);
    one that makes vLLM load code (trust-remote-code, a worker extension, ...) is refused (exit 2).
    A .gguf (any, not only optkit's): exit 2 naming each problem when it is truncated, not GGUF, lacks
    metadata or tensors llama.cpp needs for its architecture, or has blocks that decode to NaN/inf, or
    (with llama-cpp-python installed) when llama.cpp cannot load it.

    Example: optkit verify out/small-gptq-w4 --load transformers ; optkit verify model.gguf
    """
    from optkit.cli.gguf_file import is_file_argument, verify_gguf

    if is_file_argument(artifact):
        _check_against_release(Path(artifact), json_output)
        verify_gguf(Path(artifact), load, json_output)
        return
    require_supported(artifact)
    from optkit.errors import OptkitError
    from optkit.manifest import MANIFEST, read_manifest, verify_files
    from optkit.modeldir import resolve_model_dir

    path = Path(artifact)
    if not (path / MANIFEST).is_file():  # a release of a .gguf has no config.json, and needs none here
        path = resolve_model_dir(artifact)
    manifest = read_manifest(path)
    if manifest is None:
        raise OptkitError(f"{path} has no optkit.json: verify checks artifacts written by optkit")
    if load not in (None, "transformers"):
        raise OptkitError(f"--load {load!r} is not a loader verify runs: give --load transformers")
    if load and not (path / "config.json").is_file():
        raise OptkitError(f"--load transformers: {path} has no config.json: verify its .gguf with --load llama.cpp")
    problems = verify_files(path, manifest)
    if not problems and (path / "config.json").is_file():
        from optkit.pipeline.vllm_deploy import check_vllm_config

        problems = check_vllm_config(path)  # a release's vllm.yaml: what its artifact needs, nothing that loads code
    if load and not problems:
        from optkit.compat.transformers_load import check_transformers_load

        problems = [f"transformers: {p}" for p in check_transformers_load(path).problems]
    if json_output:
        print_json({"artifact": str(path), "files": len(manifest["files"]), "problems": problems, "ok": not problems})
    elif problems:
        for problem in problems:  # file names are the artifact's: shown as text, never as markup
            console().print("[bold red]mismatch[/]", rich_text(problem))
    else:
        loaded = ", loads in transformers with the runtime's logits" if load else ""
        line = f"{path}: {len(manifest['files'])} files match optkit.json{loaded}"
        console().print("[bold green]ok[/]", rich_text(line))
    raise typer.Exit(1 if problems else 0)


def _check_against_release(file: Path, json_output: bool) -> None:
    """A file that an optkit release's optkit.json (beside it) lists must have the sha256 listed
    there: exit 1 naming it when it does not. A file no manifest lists is left to the file's checks."""
    from optkit.artifacts import file_sha256
    from optkit.manifest import MANIFEST, confined_file, read_manifest

    digest = (read_manifest(file.parent) or {}).get("files", {}).get(file.name)
    if digest is None or confined_file(file.parent, file.name, MANIFEST) is None:
        return
    if file_sha256(file) == digest:
        return
    problem = f"{file.name}: sha256 differs from {file.parent / MANIFEST}"
    if json_output:
        print_json({"artifact": str(file), "problems": [problem], "ok": False})
    else:
        console().print("[bold red]mismatch[/]", rich_text(problem))
    raise typer.Exit(1)
