"""The package's import graph: no module or package imports itself round a circle, and the layers DESIGN.md
draws hold (the runtime never imports the language or the interpreter; plug-ins depend on the scheduler, not the
reverse). Every import counts, also those inside functions; only `if TYPE_CHECKING:` blocks are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_PACKAGE = {"tests", "benchmarks", "examples", "docs", "build", "dist"}


def module_files() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] in NOT_PACKAGE or parts[0].startswith(".") or parts == ("setup",):
            continue
        name = ".".join(("furcate", *parts)).removesuffix(".__init__")
        modules[name] = path
    return modules


MODULES = module_files()


def imported(name: str, path: Path) -> set[str]:
    """The furcate modules `name` imports."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {dep for dep in found if dep in MODULES and dep != name}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def package_graph() -> dict[str, set[str]]:
    """Sibling packages' edges (a package importing its own parent or children is no circle between packages)."""
    graph: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        own = package_of(name)
        graph.setdefault(own, set()).update(
            package_of(dep) for dep in deps
            if not (package_of(dep).startswith(own) or own.startswith(package_of(dep))))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_round_a_circle():
    assert circles(GRAPH) == []


def test_no_package_imports_itself_round_a_circle():
    assert circles(package_graph()) == []


@pytest.mark.parametrize("importer, imported_prefix", [
    ("furcate.runtime", "furcate.lang"), ("furcate.runtime", "furcate.interpreter"),
    ("furcate.lang", "furcate.runtime"), ("furcate.lang", "furcate.interpreter"),
    ("furcate.runtime.scheduler", "furcate.runtime.disaggregation"),
])
def test_layers(importer, imported_prefix):
    crossing = sorted(f"{name} -> {dep}" for name, deps in GRAPH.items() if name.startswith(importer)
                      for dep in deps if dep.startswith(imported_prefix))
    assert crossing == []


def test_the_graph_is_read():
    """Guards the test itself: known edges are seen, so an empty circle list means something."""
    assert "furcate.runtime.scheduler.launchers" in GRAPH["furcate.runtime.scheduler.scheduler"]
    assert "furcate.runtime.scheduler.plugins" in GRAPH["furcate.runtime.disaggregation.prefill"]
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
