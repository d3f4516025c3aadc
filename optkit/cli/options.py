"""Options shared by several commands, declared once."""

from pathlib import Path
from typing import Annotated

import typer

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace --out if it already exists.")]
OutDir = Annotated[Path, typer.Option("--out", "-o", help="Directory to write (created atomically).")]
EvalSet = Annotated[
    str, typer.Option("--eval-set", help="Bundled set name (heldout, calib) or a .txt/.jsonl/.parquet file.")
]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per evaluation window.")]


def console():
    from rich.console import Console

    return Console()


def print_json(data) -> None:
    import json

    print(json.dumps(data, indent=2, default=str))
