"""`optkit inspect` and `optkit verify` given a .gguf file rather than an artifact directory."""

from pathlib import Path

import typer

from optkit.cli.options import console, print_json, print_table
from optkit.text_safety import printable, rich_text


def is_file_argument(artifact: str) -> bool:
    """A file is read as GGUF (its magic is checked there); a directory or a model name as an artifact."""
    return Path(artifact).is_file()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _merges(count: int | None) -> str:
    """A BPE vocabulary's merges (a SentencePiece one has none: its pieces' scores order them)."""
    return f", {count} merges" if count is not None else ""


def inspect_gguf(path: Path, json_output: bool) -> None:
    from rich.table import Table

    from optkit.quant.formats.gguf_inspect import summary

    info = summary(path)
    if json_output:
        print_json(info)
        return
    out = console()
    about = Table(title=rich_text(f"GGUF {path}"), show_header=False)
    about.add_column()
    about.add_column(overflow="fold")
    tok, chat = info["tokenizer"], info["chat_template"]
    rows = [
        ("architecture", info["architecture"]),
        ("name", info["name"]),
        ("file type", info["file_type"]),
        ("size", f"{_mib(info['size_bytes'])} MiB, {info['parameters']:,} parameters, GGUF v{info['gguf_version']}"),
        *((key, value) for key, value in info["hyperparameters"].items()),
        ("tokenizer", f"{tok['model']} (pre {tok['pre']}), {tok['vocab_size']} tokens{_merges(tok['merges'])}"),
        ("special tokens", f"bos {tok['bos_token_id']}, eos {tok['eos_token_id']}, add bos {tok['add_bos_token']}"),
        ("chat template", f"present ({chat['chars']} characters)" if chat["present"] else "absent"),
        ("quantized by", info["quantized_by"]),
    ]
    if info["optkit"]:
        rows.append(("optkit", _optkit_line(info["optkit"])))
    for key, value in rows:
        about.add_row(rich_text(key), rich_text(f"{value:.7g}" if isinstance(value, float) else value))
    out.print(about)
    types = Table(title="tensors by type")
    for column in ("type", "tensors", "parameters", "MiB", "bits/weight"):
        types.add_column(column, justify="left" if column == "type" else "right")
    for row in info["types"]:
        types.add_row(
            rich_text(row["type"]),
            str(row["tensors"]),
            f"{row['parameters']:,}",
            _mib(row["bytes"]),
            f"{row['bits_per_weight']:.2f}",
        )
    print_table(types, out)
    groups = Table(title="tensors (blk.*: every block; shapes in GGUF order, row length first)")
    for column in ("tensor", "type", "shape", "count", "MiB"):
        groups.add_column(column, justify="left" if column in ("tensor", "type") else "right")
    for row in info["groups"]:
        shape = "×".join(map(str, row["shape"]))
        groups.add_row(rich_text(row["name"]), rich_text(row["type"]), shape, str(row["count"]), _mib(row["bytes"]))
    print_table(groups, out)


def _optkit_line(manifest: dict) -> str:
    """What optkit's manifest (the `optkit.manifest` key) says of the file, in one line."""
    weights = _get(_get(manifest, "options"), "weights")
    symmetric = "sym" if _get(weights, "symmetric") else "asym"
    scheme = f"{_get(weights, 'bits')}-bit g{_get(weights, 'group_size')} {symmetric}"
    calibration = _get(_get(manifest, "calibration"), "name") or "none"
    return f"{_get(manifest, 'method')} {scheme}, calibration {calibration}; optkit inspect --json shows the manifest"


def _get(mapping, key: str):
    """mapping[key] when mapping is a dict holding it (a manifest read from a file may hold anything)."""
    return mapping.get(key) if isinstance(mapping, dict) else None


def verify_gguf(path: Path, load: str | None, json_output: bool) -> None:
    """Exit 0 when every check passes; 2 naming the first problem in one line (stderr, as the CLI's
    other errors), or every problem in the JSON's `problems`."""
    from optkit.errors import OptkitError
    from optkit.gate.llama_cpp import llama_cpp_available
    from optkit.quant.formats.gguf_check import check_file

    if load not in (None, "llama.cpp"):
        raise OptkitError(f"--load {load!r}: a .gguf is loaded by llama.cpp: give --load llama.cpp or no --load")
    if load and not llama_cpp_available():
        raise OptkitError("--load llama.cpp needs llama-cpp-python: pip install 'optkit[gguf]'")
    report = {"artifact": str(path), "format": "gguf", "checked": [], "warnings": [], "llama_cpp": "not run"}
    try:
        result = check_file(path)
    except OptkitError as e:  # the header does not parse: nothing else can be checked
        if not json_output:
            raise
        _print_verdict({**report, "problems": [str(e).removeprefix(f"{path}: ")], "ok": False}, path, json_output)
    problems = list(result.problems)
    if not problems and llama_cpp_available():
        from optkit.compat.llama_cpp_load import check_llama_cpp_load

        problems += check_llama_cpp_load(path)
        result.checked.append("llama.cpp")
        report["llama_cpp"] = "failed" if problems else "loaded, logits finite"
    elif not problems:
        report["llama_cpp"] = "not installed (pip install 'optkit[gguf]'), skipped"
    report.update(
        tensors=len(result.header.tensors),
        size_bytes=result.header.file_size,
        checked=result.checked,
        warnings=result.warnings,
        problems=problems,
        ok=not problems,
    )
    _print_verdict(report, path, json_output)


def _print_verdict(report: dict, path: Path, json_output: bool) -> None:
    import sys

    if json_output:
        print_json(report)
    else:
        problems = report["problems"]
        if problems:  # one line, as every refusal: the first problem, and how to see the rest
            more = f" (and {len(problems) - 1} more: --json lists them)" if len(problems) > 1 else ""
            print(printable(f"error: {path}: {problems[0]}{more}"), file=sys.stderr)
        else:
            for warning in report["warnings"]:
                print(printable(f"warning: {path}: {warning}"), file=sys.stderr)
            line = f"{path}: {report['tensors']} tensors; {', '.join(report['checked'])} check out; "
            console().print("[bold green]ok[/]", rich_text(line + f"llama.cpp: {report['llama_cpp']}"))
    raise typer.Exit(0 if report["ok"] else 2)
