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
Speculative = Annotated[
    str | None,
    typer.Option(
        "--speculative",
        help="Speculative decoding: 'ngram' (prompt lookup) or 'draft:PATH' (a smaller model with the same tokenizer).",
    ),
]
NumSpeculativeTokens = Annotated[
    int, typer.Option("--num-speculative-tokens", min=1, help="Tokens proposed per sequence and step (--speculative).")
]

EnforceEager = Annotated[
    bool, typer.Option("--enforce-eager", help="Run every step eagerly: no CUDA graphs for decode steps (CUDA).")
]


def console():
    """stdout for people: a plain line is never wrapped, so paths and verdicts stay whole on one
    line for whoever reads them, at any terminal width (the terminal may fold it on screen)."""
    from rich.console import Console

    return Console(soft_wrap=True)


def print_table(table, out=None) -> None:
    """Print a table of names and numbers whole: on a terminal narrower than the table, its lines
    run past the edge, as plain lines do, instead of rich cutting names ("model.…") and numbers to
    fit. (Columns of free text should wrap instead: give them overflow="fold".)"""
    out = out or console()
    natural = out.measure(table, options=out.options.update_width(1 << 16)).maximum
    if natural > out.width:
        table.width = natural
    out.print(table)


def print_json(data) -> None:
    import json

    print(json.dumps(data, indent=2, default=str))
