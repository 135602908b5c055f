"""The language as data: every expression a program adds to its state is a frozen dataclass.

Nothing here runs a model, touches a thread or imports torch; the interpreter gives these nodes meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..grammars.spec import GrammarSpec
from .choices import ChoicesMethod


class Expr:
    """Base of every expression; `+` concatenates expressions and strings."""

    def __add__(self, other: Any) -> Concat:
        return Concat.of(self, other)

    def __radd__(self, other: Any) -> Concat:
        return Concat.of(other, self)

    def describe(self) -> str:
        """How error messages name this node."""
        return type(self).__name__.lower()


def as_expr(value: Any) -> Expr:
    """A string becomes constant text; anything else that is not an expression is a clear error."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    if value is None:
        raise ValueError("cannot add None to a program state")
    raise TypeError(f"cannot add a {type(value).__name__} to a program state; add a string or an expression "
                    f"(gen, select, a role, ...); convert values with str() first")


@dataclass(frozen=True)
class Constant(Expr):
    text: str

    def describe(self) -> str:
        preview = self.text if len(self.text) <= 30 else self.text[:27] + "..."
        return f"text {preview!r}"


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple[Expr, ...]

    @classmethod
    def of(cls, *items: Any) -> Concat:
        parts: list[Expr] = []
        for item in items:
            expr = as_expr(item)
            parts.extend(expr.parts if isinstance(expr, Concat) else (expr,))
        return cls(tuple(parts))

    def describe(self) -> str:
        return " + ".join(part.describe() for part in self.parts)


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text into variable `name`.

    `sampling` holds only the fields set on this gen, in the runtime's names (max_new_tokens, stop, ...);
    the rest inherit the defaults given to run(). `output_type` is what `state.get(name)` parses into.
    """

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    constraint: GrammarSpec | None = None
    output_type: Any = None

    def describe(self) -> str:
        return f"gen({self.name!r})"


@dataclass(frozen=True)
class SeparateReasoning(Expr):
    """Run `expr` (a gen), then split its variable: the think block goes to `<name>_reasoning_content`, the answer
    stays under `name`. The program's text keeps both."""

    expr: Gen
    model_type: str

    def describe(self) -> str:
        return f"separate_reasoning({self.expr.describe()}, model_type={self.model_type!r})"


@dataclass(frozen=True)
class Select(Expr):
    """Choose one of `choices` by scoring each as a continuation of the text so far."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    choices_method: ChoicesMethod

    def describe(self) -> str:
        return f"select({self.name!r})"


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str

    def describe(self) -> str:
        return f"{self.role}_begin"


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str

    def describe(self) -> str:
        return f"{self.role}_end"


@dataclass(frozen=True)
class Image(Expr):
    source: Any  # a path, URL, base64 string, encoded bytes or a PIL image

    def describe(self) -> str:
        return "image"


@dataclass(frozen=True)
class Video(Expr):
    source: str
    num_frames: int

    def describe(self) -> str:
        return "video"


@dataclass(frozen=True)
class VarRef(Expr):
    """The current value of a variable of the same state, as text."""

    name: str

    def describe(self) -> str:
        return f"variable {self.name!r}"


@dataclass(frozen=True)
class SetVar(Expr):
    name: str
    value: Any

    def describe(self) -> str:
        return f"set {self.name!r}"


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str

    def describe(self) -> str:
        return f"var_scope({self.name!r})"


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str

    def describe(self) -> str:
        return f"end of var_scope({self.name!r})"


@dataclass(frozen=True)
class CommitPrefix(Expr):
    """Send the text so far to the backend's prefix cache (before a fork, so its children share it)."""

    def describe(self) -> str:
        return "commit of the shared prefix"


class StopTracing(Exception):
    """Tracing (tracing.py) met something it cannot know: an argument's value, a generated variable."""


@dataclass(frozen=True)
class Argument(Expr):
    """A program argument during tracing: its value is unknown, so the constant prefix ends here."""

    name: str

    def __str__(self) -> str:
        raise StopTracing(f"argument {self.name!r} used as text")

    def __format__(self, spec: str) -> str:
        return str(self)

    def describe(self) -> str:
        return f"argument {self.name!r}"


def defined_names(expr: Expr) -> list[str | None]:
    """The variables an expression sets when it runs (reads of them wait for it)."""
    if isinstance(expr, Concat):
        return [name for part in expr.parts for name in defined_names(part)]
    if isinstance(expr, (Gen, Select)):
        return [expr.name]
    if isinstance(expr, (SetVar, VarScopeEnd)):
        return [expr.name]
    if isinstance(expr, SeparateReasoning):
        return [expr.expr.name, f"{expr.expr.name}_reasoning_content"]
    return []
