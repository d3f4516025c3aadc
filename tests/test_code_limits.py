"""Size limits of optkit's code: no function over 80 lines, no module over 400, and no logic written
twice (a run of 6 identical code lines in two places). Import cycles: tests/test_import_layers.py."""

import ast
import io
import textwrap
import tokenize
from collections import defaultdict
from pathlib import Path

import optkit

PACKAGE_ROOT = Path(optkit.__file__).resolve().parent
MAX_FUNCTION_LINES = 80  # def to its last line, docstring included (a nested function counts on its own too)
MAX_MODULE_LINES = 400
MIN_REPEATED_LINES = 6  # code lines: blank lines, comments, docstrings, imports and lone brackets not counted
TOO_COMMON = 8  # a run standing in more places than this is boilerplate, as for the `duplicates` tool

# Functions and modules not yet split ("path:qualified name", "path"): it may only shrink.
KNOWN_OVER_LIMIT: set[str] = set()
# Pairs of modules that still repeat a run of lines ("a.py ~ b.py", in sorted order): it may only shrink.
KNOWN_REPEATS: set[str] = set()


def _sources() -> dict[str, str]:
    return {str(f.relative_to(PACKAGE_ROOT)): f.read_text() for f in sorted(PACKAGE_ROOT.rglob("*.py"))}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, tuple[int, int]]:
    """Qualified name (Class.method, outer.inner) -> (first line, length) of every function over `limit`."""
    found = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                length = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and length > limit:
                    found[name] = (child.lineno, length)
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def code_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text with white space folded) of the lines that carry logic."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        docstring = (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        )
        if docstring or isinstance(node, ast.Import | ast.ImportFrom):
            skipped.update(range(node.lineno, node.end_lineno + 1))
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:  # cut the comment off its line
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    kept = []
    for number, line in enumerate(lines, start=1):
        text = " ".join(line.split())
        if number not in skipped and text and not all(c in "()[]{},:;*/." for c in text):
            kept.append((number, text))
    return kept


def repeated_runs(sources: dict[str, str], length: int = MIN_REPEATED_LINES) -> dict[str, tuple[int, int]]:
    """ "a.py ~ b.py" -> (line in a, line in b) of the first run of `length` identical code lines the
    two share (a ~ a: a run written twice in one module)."""
    places: dict[tuple[str, ...], list[tuple[str, int, int]]] = defaultdict(list)
    for path, source in sources.items():
        lines = code_lines(source)
        for i in range(len(lines) - length + 1):
            run = lines[i : i + length]
            places[tuple(text for _, text in run)].append((path, run[0][0], run[-1][0]))
    pairs: dict[str, tuple[int, int]] = {}
    for where in places.values():
        if len(where) > TOO_COMMON:
            continue
        for i, (path_a, start_a, end_a) in enumerate(where):
            for path_b, start_b, _ in where[i + 1 :]:
                if path_a == path_b and start_b <= end_a:  # one run overlapping itself
                    continue
                (a, line_a), (b, line_b) = sorted([(path_a, start_a), (path_b, start_b)])
                pairs.setdefault(f"{a} ~ {b}", (line_a, line_b))
    return pairs


def test_long_functions_counts_methods_and_nested_functions():
    body = "".join(f"x{i} = {i}\n" for i in range(80))
    source = (
        f"class A:\n    def m(self):\n{textwrap.indent(body, ' ' * 8)}\n"
        f"def f():\n    def g():\n{textwrap.indent(body, ' ' * 8)}    return g\n"
        f"def short():\n{textwrap.indent(body[: body.index('x79')], ' ' * 4)}"
    )
    assert long_functions(source) == {"A.m": (2, 81), "f": (84, 83), "f.g": (85, 81)}


def test_repeated_runs_finds_six_identical_lines_and_not_five():
    logic = [f"total = total * {i} + step" for i in range(6)]
    noise = ["    # a comment", "    from os import (", "        path,", "    )", "", '    """A string."""']
    a = ["def f(step):", *(f"    {line}" for line in logic[:3]), *noise, *(f"    {line}  # note" for line in logic[3:])]
    b = ["def g(step):", "", *(f"  {line}" for line in logic)]
    assert repeated_runs({"a.py": "\n".join(a), "b.py": "\n".join(b)}) == {"a.py ~ b.py": (2, 3)}
    assert repeated_runs({"a.py": "\n".join(a), "b.py": "\n".join(b[:-1])}) == {}
    assert repeated_runs({"a.py": "\n".join([*a, *a[1:]])}) == {"a.py ~ a.py": (2, 14)}


def test_no_function_or_module_over_the_limits():
    found = {}
    for path, source in _sources().items():
        for name, (line, length) in long_functions(source).items():
            found[f"{path}:{name}"] = f"optkit/{path}:{line} {name} is {length} lines (limit {MAX_FUNCTION_LINES})"
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            found[path] = f"optkit/{path} is {lines} lines (limit {MAX_MODULE_LINES})"
    new = [message for key, message in sorted(found.items()) if key not in KNOWN_OVER_LIMIT]
    assert not new, "split these into smaller single-purpose pieces:\n" + "\n".join(new)
    fixed = sorted(KNOWN_OVER_LIMIT - set(found))
    assert not fixed, f"within the limits now: remove them from KNOWN_OVER_LIMIT: {fixed}"


def test_no_logic_written_twice():
    found = repeated_runs(_sources())
    new = [
        f"optkit/{pair.split(' ~ ')[0]}:{a} ~ optkit/{pair.split(' ~ ')[1]}:{b}"
        for pair, (a, b) in sorted(found.items())
        if pair not in KNOWN_REPEATS
    ]
    assert not new, f"{MIN_REPEATED_LINES}+ identical code lines in two places; give them one home:\n" + "\n".join(new)
    fixed = sorted(KNOWN_REPEATS - set(found))
    assert not fixed, f"no longer repeated: remove them from KNOWN_REPEATS: {fixed}"
