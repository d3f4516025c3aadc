"""`optkit verify`: recheck an artifact against its manifest."""

from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, console, print_json


def verify(
    artifact: Annotated[str, typer.Argument(help="Artifact directory written by optkit.")],
    json_output: JsonFlag = False,
) -> None:
    """Recheck the sha256 of every file listed in optkit.json; exit 1 naming any that differ.

    Example: optkit verify out/small-gptq-w4
    """
    from optkit.errors import OptkitError
    from optkit.manifest import read_manifest, verify_files
    from optkit.modeldir import resolve_model_dir

    path = resolve_model_dir(artifact)
    manifest = read_manifest(path)
    if manifest is None:
        raise OptkitError(f"{path} has no optkit.json: verify checks artifacts written by optkit")
    problems = verify_files(path, manifest)
    if json_output:
        print_json({"artifact": str(path), "files": len(manifest["files"]), "problems": problems, "ok": not problems})
    elif problems:
        for problem in problems:
            console().print(f"[bold red]mismatch[/] {problem}")
    else:
        console().print(f"[bold green]ok[/] {path}: {len(manifest['files'])} files match optkit.json")
    raise typer.Exit(1 if problems else 0)
