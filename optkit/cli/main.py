"""The `optkit` command: one typer app, one module per command, one handler for user errors."""

import errno
import json
import os
import sys
import traceback

import typer

from optkit.cli import bench as bench_cmd
from optkit.cli import compile as compile_cmd
from optkit.cli import eval as eval_cmd
from optkit.cli import generate as generate_cmd
from optkit.cli import inspect as inspect_cmd
from optkit.cli import quantize as quantize_cmd
from optkit.cli import run as run_cmd
from optkit.cli import serve as serve_cmd
from optkit.cli import speculator as speculator_cmd
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
app.command("quantize", no_args_is_help=False, cls=quantize_cmd.QuantizeCommand)(quantize_cmd.quantize)
app.command("eval")(eval_cmd.eval_)
app.command("inspect")(inspect_cmd.inspect)
app.command("verify")(verify_cmd.verify)
app.command("run")(run_cmd.run)
app.command("generate")(generate_cmd.generate)
app.command("serve")(serve_cmd.serve)
app.command("bench")(bench_cmd.bench)
app.command("compile")(compile_cmd.compile_)
app.add_typer(zoo_cmd.app, name="zoo")
app.add_typer(speculator_cmd.app, name="speculator")


# What to do about an OSError, by errno; the line also names the file and the system's reason.
_OS_REMEDIES = {
    errno.EACCES: "give this user access to it or choose another path",
    errno.EPERM: "give this user access to it or choose another path",
    errno.EROFS: "that file system is read-only: choose another path",
    errno.ENOSPC: "the disk is full: free space or choose another path",
    errno.EDQUOT: "the disk quota is used up: free space or choose another path",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a file stands where a directory is needed: choose another path",
    errno.EISDIR: "a directory stands where a file is needed: choose another path",
    errno.EEXIST: "something is already there: move it or choose another path",
}


def describe_failure(e: Exception) -> tuple[str, int]:
    """The one line and exit code for an exception that escaped a command: 2 for the user's input
    and the machine's files (never 1, which means "the gate rejected"), 3 for a bug in optkit."""
    from pydantic import ValidationError
    from safetensors import SafetensorError

    from optkit.errors import MAX_LINE_CHARS, OptkitError, shorten

    if isinstance(e, OptkitError):
        return shorten(str(e), MAX_LINE_CHARS), e.exit_code  # one line, whatever values it quotes
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        where = shorten(".".join(str(p) for p in first["loc"]))
        return f"invalid option {where}: {shorten(first['msg'], MAX_LINE_CHARS // 2)}", 2
    if isinstance(e, OSError):
        names = [f for f in (e.filename, e.filename2) if f is not None]
        where = " -> ".join(os.fsdecode(f) if isinstance(f, bytes) else str(f) for f in names)
        reason = e.strerror or str(e) or type(e).__name__
        if not where:
            return f"{reason}: OPTKIT_DEBUG=1 shows where it happened", 2
        return f"{where}: {reason}: {_OS_REMEDIES.get(e.errno, 'check that path and its disk')}", 2
    if isinstance(e, json.JSONDecodeError):
        where = f"line {e.lineno} column {e.colno}"
        return f"a JSON file is not valid JSON ({e.msg} at {where}): OPTKIT_DEBUG=1 shows which; re-create it", 2
    if isinstance(e, SafetensorError):
        return f"a safetensors file is truncated or corrupt ({e}): OPTKIT_DEBUG=1 shows which; re-create it", 2
    return f"internal error ({type(e).__name__}: {shorten(str(e), 500)}); please report it with the traceback above", 3


def main() -> None:
    """Entry point: one line on stderr for every failure; exit 2 for bad input or an unusable
    file, 3 (with the traceback) for a bug; OPTKIT_DEBUG=1 shows every traceback."""
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        from optkit.text_safety import printable

        line, code = describe_failure(e)
        if code == 3 or os.environ.get("OPTKIT_DEBUG"):
            traceback.print_exc()
        print(f"error: {printable(line)}", file=sys.stderr)  # file names and values may hold ESC
        sys.exit(code)


if __name__ == "__main__":
    main()
