"""A program: the decorated function and the arguments bound to it ahead of time."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Program:
    func: Callable[..., Any]
    bound: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.func):
            raise TypeError(f"@function decorates a function, got {self.func!r}")
        if not list(inspect.signature(self.func).parameters):
            raise TypeError(f"{self.name}: a program's first parameter is the state, e.g. `def {self.name}(s, ...)`")

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", "program")

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    @property
    def arg_names(self) -> list[str]:
        """The program's own parameters (after the state), not counting *args / **kwargs."""
        params = list(inspect.signature(self.func).parameters.values())[1:]
        return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    def bind(self, **kwargs: Any) -> Program:
        unknown = self._unknown(kwargs)
        if unknown:
            raise TypeError(f"{self.name}() has no parameter(s) {', '.join(unknown)}")
        return Program(self.func, {**self.bound, **kwargs})

    def arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional and keyword arguments (plus bound ones) as keywords; a mismatch is a TypeError."""
        merged = {**self.bound, **kwargs}
        params = list(inspect.signature(self.func).parameters.values())[1:]
        try:
            bound = inspect.Signature(params).bind(*args, **merged)
        except TypeError as error:
            raise TypeError(f"{self.name}(): {error}") from None
        return dict(bound.arguments)

    def _unknown(self, kwargs: dict[str, Any]) -> list[str]:
        params = list(inspect.signature(self.func).parameters.values())[1:]
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return []
        return sorted(set(kwargs) - set(self.arg_names))
