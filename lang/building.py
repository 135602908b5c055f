"""The state methods that only add expressions (roles, variable scopes), shared by the real state and the tracer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .api import role
from .ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd


class BuildingMethods:
    """Mixed into anything with `_add(expr)`."""

    def _add(self, expr: Expr) -> None:
        raise NotImplementedError

    def _role(self, name: str, expr: Any = None):
        if expr is not None:
            self._add(role(name, expr))
            return None
        return self._scope(RoleBegin(name), RoleEnd(name))

    def system(self, expr: Any = None):
        """`s.system("...")` adds a system turn; `with s.system():` wraps what is added inside."""
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def var_scope(self, name: str):
        """`with s.var_scope("x"):` stores the text added inside the block in variable x."""
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))

    @contextlib.contextmanager
    def _scope(self, begin: Expr, end: Expr) -> Iterator[None]:
        self._add(begin)
        yield
        self._add(end)
