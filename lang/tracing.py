"""Run a program on placeholder arguments to find the constant text it always starts with.

`run_batch` sends that prefix to the backend once, so every program of the batch finds it cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .building import BuildingMethods
from .ir import Argument, Concat, Constant, Expr, RoleBegin, RoleEnd, StopTracing, as_expr
from .program import Program


@dataclass
class Trace:
    nodes: list[Expr]
    stopped_by: str | None  # why tracing ended early, or None when the program ran to its end


class TracerState(BuildingMethods):
    """Stands in for ProgramState while tracing: records what is added, stops at anything data-dependent."""

    def __init__(self) -> None:
        self.nodes: list[Expr] = []

    def _add(self, expr: Expr) -> None:
        self.nodes.append(expr)

    def __iadd__(self, other: Any) -> TracerState:
        self._add(as_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        raise StopTracing(f"read of variable {name!r}")

    def __contains__(self, name: str) -> bool:
        raise StopTracing(f"test for variable {name!r}")

    def __getattr__(self, name: str) -> Any:
        raise StopTracing(f"state.{name}")


def trace(program: Program) -> Trace:
    """Record what the program adds when every argument is a placeholder, up to the first thing it cannot do."""
    state = TracerState()
    placeholders = {name: Argument(name) for name in program.arg_names if name not in program.bound}
    try:
        result = program.func(state, **{**placeholders, **program.bound})
        if program.is_async:
            result.close()  # an async program is not traced (its awaits may need real values)
            return Trace([], "async program")
    except StopTracing as stop:
        return Trace(state.nodes, str(stop))
    except Exception as error:  # noqa: BLE001 - any failure on placeholders just ends the trace
        return Trace(state.nodes, f"{type(error).__name__}: {error}")
    return Trace(state.nodes, None)


def constant_prefix(nodes: list[Expr]) -> list[Expr]:
    """The leading nodes whose text is known before running: constant text and role markers."""
    prefix: list[Expr] = []
    for node in _flatten(nodes):
        if not isinstance(node, (Constant, RoleBegin, RoleEnd)):
            break
        prefix.append(node)
    return prefix


def _flatten(nodes: list[Expr]) -> Iterator[Expr]:
    for node in nodes:
        if isinstance(node, Concat):
            yield from _flatten(list(node.parts))
        else:
            yield node
