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
    from rich.console import Console

    return Console()


def print_json(data) -> None:
    import json

    print(json.dumps(data, indent=2, default=str))
