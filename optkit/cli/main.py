"""The `optkit` command: one typer app, one module per command, one handler for user errors."""

import os
import sys

import typer

from optkit.cli import bench as bench_cmd
from optkit.cli import compile as compile_cmd
from optkit.cli import eval as eval_cmd
from optkit.cli import generate as generate_cmd
from optkit.cli import inspect as inspect_cmd
from optkit.cli import quantize as quantize_cmd
from optkit.cli import run as run_cmd
from optkit.cli import serve as serve_cmd
from optkit.cli import verify as verify_cmd
from optkit.cli import zoo as zoo_cmd

app = typer.Typer(
    name="optkit",
    help="Quantize a Hugging Face causal LM, prove it kept its quality, and ship it.\n\n"
    "Example: optkit quantize small --bits 4 --out out/small-w4 && optkit eval out/small-w4 --baseline small",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("quantize", no_args_is_help=False)(quantize_cmd.quantize)
app.command("eval")(eval_cmd.eval_)
app.command("inspect")(inspect_cmd.inspect)
app.command("verify")(verify_cmd.verify)
app.command("run")(run_cmd.run)
app.command("generate")(generate_cmd.generate)
app.command("serve")(serve_cmd.serve)
app.command("bench")(bench_cmd.bench)
app.command("compile")(compile_cmd.compile_)
app.add_typer(zoo_cmd.app, name="zoo")


def main() -> None:
    """Entry point: known user errors print one line and exit 2; OPTKIT_DEBUG=1 shows tracebacks."""
    from pydantic import ValidationError

    from optkit.errors import OptkitError

    try:
        app()
    except OptkitError as e:
        if os.environ.get("OPTKIT_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except ValidationError as e:
        if os.environ.get("OPTKIT_DEBUG"):
            raise
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"error: invalid option {where}: {first['msg']}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
