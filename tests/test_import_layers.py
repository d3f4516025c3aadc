"""Dependencies between optkit's packages point one way: no import cycle between packages, counting
imports inside functions too (they hide a cycle, they do not remove it)."""

import ast
from pathlib import Path

import optkit

PACKAGE_ROOT = Path(optkit.__file__).resolve().parent

# Cycles not yet taken apart: empty since issue 17, and it may only shrink.
KNOWN_CYCLES: list[set[str]] = []


def unit(module: str) -> str:
    """optkit.quant.gptq -> optkit.quant; optkit.modeldir -> optkit.modeldir."""
    return ".".join(module.split(".")[:2])


def package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for file in PACKAGE_ROOT.rglob("*.py"):
        parts = file.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        source = unit(".".join(parts).removesuffix(".__init__"))
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith("optkit.") and unit(name) != source:
                    edges.setdefault(source, set()).add(unit(name))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_ring_and_nothing_else():
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(ring) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_new_import_cycle_between_packages():
    found = cycles(package_edges())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, f"import cycles between packages: {new}; make the lower package stop importing the higher one"
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"{gone} is no longer a cycle: remove it from KNOWN_CYCLES"


def test_the_weights_package_imports_nothing_above_it():
    edges = package_edges()
    assert edges.get("optkit.weights", set()) <= {"optkit.errors"}
    # where optkit keeps what it builds: above nothing but the errors its checks raise
    assert edges.get("optkit.cache", set()) <= {"optkit.errors"}
    assert edges.get("optkit.errors", set()) <= {"optkit.text_safety"}  # the bottom: errors quote file text
    # kernels: the weights they compute with; cpu_w4a8 builds its C++ into optkit's cache directory
    assert edges.get("optkit.kernels", set()) <= {"optkit.weights", "optkit.errors", "optkit.cache"}


def test_routing_knows_nothing_of_http():
    """routing/ raises domain errors; server/ owns HTTP and maps them to status codes."""
    assert not package_edges().get("optkit.routing", set()) & {"optkit.server", "optkit.cli", "optkit.pipeline"}
    http = {"fastapi", "starlette", "uvicorn", "prometheus_client"}
    for file in (PACKAGE_ROOT / "routing").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & http, f"{file.name} imports {names}"
