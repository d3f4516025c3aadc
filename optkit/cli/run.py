"""`optkit run`: the release pipeline CI calls."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, console, print_json, print_table, require_supported


def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (see recipes/).")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Release directory (default: the recipe's output).")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value (repeatable).")
    ] = None,
    device: Annotated[str, typer.Option(help="Compute device for calibration: auto, cpu, cuda.")] = "auto",
    json_output: JsonFlag = False,
) -> None:
    """Quantize, gate and package a release; exit 1 (release marked rejected) if the gate fails.

    Exit codes: 0 released, 1 rejected, 2 bad input (a recipe without a gate threshold too), 3 a bug,
    4 inconclusive (gate.decision: confident and the eval set cannot tell; marked inconclusive).

    Example: optkit run recipes/small-gptq-w4.yaml --set gate.max_kld=0.005
    """
    require_supported(_recipe_model(recipe, set_ or []))
    from rich.table import Table

    from optkit.pipeline.recipe import load_recipe
    from optkit.pipeline.run import run_recipe

    parsed, raw = load_recipe(recipe, set_ or [])
    result = run_recipe(parsed, raw, recipe_path=recipe, out=out, device=device)
    if json_output:
        print_json(
            {"release": str(result.release), "verdict": result.verdict, "stages": result.stages, "gate": result.gate}
        )
    else:
        table = Table(title=f"optkit run {recipe}")
        for column in ("stage", "status", "seconds"):
            table.add_column(column)
        for stage in result.stages:
            table.add_row(stage["stage"], stage["status"], f"{stage['seconds']:.1f}")
        out_console = console()
        print_table(table, out_console)
        if result.gate.get("speculative"):
            from optkit.pipeline.speculator_stage import acceptance_line

            out_console.print(acceptance_line(result.gate["speculative"]))
        color = "green" if result.passed else "yellow" if result.verdict == "inconclusive" else "red"
        out_console.print(f"[bold {color}]{result.verdict.upper()}[/] {result.release}")
    raise typer.Exit(result.exit_code)


def _recipe_model(recipe: Path, overrides: list[str]) -> str | None:
    """The recipe's base model (a `--set model=...` wins), read before the recipe is validated, so
    that an unsupported model is refused at once; None when the recipe cannot be read (load_recipe
    says why)."""
    for override in reversed(overrides):
        key, _, value = override.partition("=")
        if key.strip() == "model":
            return value.strip()
    from optkit.errors import OptkitError
    from optkit.yaml_files import read_yaml_mapping

    try:
        data = read_yaml_mapping(recipe, "recipe")  # the bounded reader: load_recipe repeats its refusal
    except (OptkitError, OSError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None
