"""The package's import graph: no module or package imports itself round a circle, and the walls
docs/architecture.md draws hold: the runtime never imports the language or the interpreter; the caller's process
(runtime/engine/) never imports the scheduler, the executor, the kernels or the model's architecture; the kernels
import nothing of the runtime but their own build helper and the cache folder; the executor never imports the
scheduler; a plug-in reaches the scheduler only through the handle protocol. Every import counts: those inside
functions and those under `if TYPE_CHECKING:` too (a type-only import is still a dependency a reader follows)."""

from __future__ import annotations

import ast
import subprocess
import sys
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
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
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


R = "furcate.runtime"
PLUGINS = f"{R}.scheduler.plugins"
# Inside the scheduler package, what a plug-in may import: the handle protocol and the plug-in base (plugins/base.py),
# the request type and the memory manager the handle hands out, and its fellow plug-ins.
PLUGIN_MAY_IMPORT = (f"{PLUGINS}.", f"{R}.scheduler.req", f"{R}.scheduler.memory")


def crossings(importer: str, imported: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """Edges from modules under `importer` to modules under `imported`, less those into `allowed` prefixes."""
    return sorted(f"{name} -> {dep}" for name, deps in GRAPH.items() if under(name, importer)
                  for dep in deps if under(dep, imported) and not dep.startswith(allowed))


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("importer, imported_prefix", [
    ("furcate.runtime", "furcate.lang"), ("furcate.runtime", "furcate.interpreter"),
    ("furcate.lang", "furcate.runtime"), ("furcate.lang", "furcate.interpreter"),
    (f"{R}.scheduler", f"{R}.disaggregation"),
    (f"{R}.engine", f"{R}.scheduler"), (f"{R}.engine", f"{R}.executor"), (f"{R}.engine", f"{R}.kernels"),
    (f"{R}.executor", f"{R}.scheduler"), (f"{R}.model", f"{R}.executor"),
])
def test_layers(importer, imported_prefix):
    assert crossings(importer, imported_prefix) == []


def test_the_engine_reads_checkpoints_but_never_builds_the_model():
    """The caller's process inspects a checkpoint (model/weights/checkpoint.py, and the GGUF conversion it starts)
    and nothing else of model/: the architecture runs in the scheduler process."""
    assert crossings(f"{R}.engine", f"{R}.model", (f"{R}.model.weights.",)) == []
    assert crossings(f"{R}.engine", f"{R}.model.weights", (f"{R}.model.weights.checkpoint",)) == []


def test_the_wire_types_are_leaves():
    """Both processes read runtime/wire/: it imports no other runtime package (but the sampling parameters a
    request carries)."""
    assert crossings(f"{R}.wire", R, (f"{R}.wire.", f"{R}.sampling.params")) == []


def test_the_kernels_import_nothing_of_the_runtime_but_their_build_helper():
    assert crossings(f"{R}.kernels", R, (f"{R}.kernels.", f"{R}.cache_folder")) == []


@pytest.mark.parametrize("plugins", [PLUGINS, f"{R}.disaggregation"])
def test_plugins_reach_the_scheduler_only_through_the_handle(plugins):
    assert crossings(plugins, f"{R}.scheduler", PLUGIN_MAY_IMPORT) == []


def test_the_engine_process_imports_no_model_code():
    """Importing the Engine (what a caller's process does) loads none of the scheduler's, the executor's, the
    kernels' or the architecture's modules, also not through another package."""
    code = ("import sys, furcate.runtime.engine, furcate.runtime.server.app; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('furcate.runtime.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    walled = (f"{R}.scheduler", f"{R}.executor", f"{R}.kernels", f"{R}.model.decoder", f"{R}.model.layers",
              f"{R}.model.moe", f"{R}.model.vision")
    assert loaded and [m for m in loaded if m.startswith(walled)] == []


def test_the_graph_is_read():
    """Guards the test itself: known edges are seen, so an empty circle list means something."""
    assert "furcate.runtime.scheduler.launchers" in GRAPH["furcate.runtime.scheduler.scheduler"]
    assert "furcate.runtime.scheduler.plugins.base" in GRAPH["furcate.runtime.disaggregation.prefill"]
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert crossings(f"{R}.disaggregation", f"{R}.scheduler") != []  # allowed edges exist, so the walls are read
