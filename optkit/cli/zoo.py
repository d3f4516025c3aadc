"""`optkit zoo`: the reference models optkit trains for itself."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, Overwrite, console, print_json, print_table

app = typer.Typer(help="Build and list the bundled reference models.", no_args_is_help=True)


@app.command("build")
def build(
    name: Annotated[str, typer.Argument(help="Reference model: small, draft, small-moe, deep or small-qwen3.")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Where to write it (default: the bundled location).")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (default: the model's recipe).")] = None,
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
) -> None:
    """Train a reference model from scratch on the standard library's sources.

    Example: optkit zoo build draft --out /tmp/draft --steps 50
    """
    from optkit.modeldir import BUNDLED_DIR
    from optkit.zoo.specs import get_spec
    from optkit.zoo.train import build_reference_model

    spec = get_spec(name)
    target = out or BUNDLED_DIR / name
    result = build_reference_model(spec, target, steps=steps, overwrite=overwrite or out is None)
    data = {
        "name": name,
        "path": str(result.path),
        "parameters": result.num_parameters,
        "steps": result.steps,
        "heldout_perplexity": result.heldout_perplexity,
        "seconds": result.seconds,
        "cpu_seconds": result.cpu_seconds,
    }
    if result.expert_shares is not None:
        data["expert_shares"] = result.expert_shares
    if json_output:
        print_json(data)
    else:
        console().print(
            f"[bold green]built[/] {name}: {result.num_parameters:,} parameters, {result.steps} steps, "
            f"held-out perplexity {result.heldout_perplexity:.2f}, {result.seconds:.0f}s -> {result.path}"
        )
        for layer, shares in enumerate(result.expert_shares or []):
            console().print(
                f"  layer {layer} held-out routing share per expert: " + " ".join(f"{s:.1%}" for s in shares)
            )


@app.command("list")
def list_models(json_output: JsonFlag = False) -> None:
    """List the reference models and whether they are built.

    Example: optkit zoo list
    """
    from rich.table import Table

    from optkit.modeldir import BUNDLED_DIR
    from optkit.zoo.specs import SPECS

    rows = [
        {
            "name": s.name,
            "hidden": s.hidden_size,
            "layers": s.num_layers,
            "heads": f"{s.num_heads}/{s.num_kv_heads}",
            "built": (BUNDLED_DIR / s.name / "config.json").exists(),
            "path": str(BUNDLED_DIR / s.name),
        }
        for s in SPECS.values()
    ]
    if json_output:
        print_json(rows)
        return
    table = Table(title="reference models")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    print_table(table)
