"""The one error a program raises for a failed node: it names the node and keeps the cause."""

from __future__ import annotations


class ProgramError(RuntimeError):
    """A node of a program failed (a rejected request, a backend failure, a bad expression).

    Raised at the read that needed the node, at `sync()` and from `run()`; `node` is its description and
    `__cause__` the original exception.
    """

    def __init__(self, node: str, cause: BaseException) -> None:
        super().__init__(f"{node} failed: {type(cause).__name__}: {cause}")
        self.node = node
        self.cause = cause
        self.__cause__ = cause
