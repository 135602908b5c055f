"""Judge a grammar backend on the jsonschemabench-dev data set (the team's copy beside the repository): does its
matcher accept each valid instance and reject each invalid one? Used by the tests and by benchmarks/structured.py.

An instance is accepted when some serialization of it goes through a fresh matcher, token by token, and the stop
token then terminates it. Serialization is free where JSON leaves it free: the backends fix the key order (to the
schema's `properties` order, extra keys after) and the separators (`, ` and `: `), so the keys are tried in the order
the matcher takes them (a depth-first search that follows the matcher) and strings with and without ASCII escapes.
The text found is then tokenized whole, as a model would produce it, and fed to a fresh matcher again.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furcate.grammars.base import CompiledGrammar, Matcher

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev"
# Feeds one key-order search may spend before it gives up on an instance (wrong keys fail at their first token, so a
# search that finds an order needs about keys squared of them).
SEARCH_BUDGET = 5000
# The fewest tokens a backend can roll back (outlines-core keeps the last 200 states); past it the matcher is rebuilt.
ROLLBACK_WINDOW = 200


def load_cases() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(BENCH.glob("*.json"))}


class Search:
    """A depth-first search for a serialization of one value that a matcher accepts."""

    def __init__(self, compiled: CompiledGrammar, encode: Callable[[str], list[int]], ensure_ascii: bool) -> None:
        self.matcher: Matcher = compiled.matcher()
        self.compiled = compiled
        self.encode = encode
        self.ensure_ascii = ensure_ascii
        self.tokens: list[int] = []  # what the matcher has accepted, to rebuild it past a backend's rollback window
        self.history = 0  # how many of those the matcher can still roll back
        self.budget = SEARCH_BUDGET

    def feed(self, text: str) -> int | None:
        """Accept text's tokens; the count, or None (state unchanged) when the matcher refuses one."""
        self.budget -= 1
        if self.budget < 0:
            return None
        taken = 0
        for token in self.encode(text):
            if not self.matcher.accept(token):
                self.undo(taken)
                return None
            self.tokens.append(token)
            self.history = min(self.history + 1, ROLLBACK_WINDOW)
            taken += 1
        return taken

    def undo(self, count: int) -> None:
        if not count:
            return
        del self.tokens[len(self.tokens) - count:]
        if count <= self.history:
            self.matcher.rollback(count)
            self.history -= count
            return
        self.matcher = self.compiled.matcher()
        for token in self.tokens:
            assert self.matcher.accept(token)
        self.history = min(len(self.tokens), ROLLBACK_WINDOW)

    def value(self, value: Any) -> str | None:
        """Emit `value`; its text, or None (state unchanged) when no serialization is accepted."""
        if isinstance(value, dict):
            return self.members(list(value.items()), "{")
        if isinstance(value, list):
            return self.items(value)
        text = json.dumps(value, ensure_ascii=self.ensure_ascii)
        return text if self.feed(text) is not None else None

    def items(self, values: list) -> str | None:
        start = len(self.tokens)
        parts = ["["]
        if self.feed("[") is None:
            return None
        for index, item in enumerate(values):
            if (index and self.feed(", ") is None) or (text := self.value(item)) is None:
                self.undo(len(self.tokens) - start)
                return None
            parts += [", "] * bool(index) + [text]
        if self.feed("]") is None:
            self.undo(len(self.tokens) - start)
            return None
        return "".join(parts + ["]"])

    def members(self, remaining: list[tuple[str, Any]], opening: str) -> str | None:
        """The rest of an object whose `opening` ("{" or ", ") comes next: each remaining key tried there in turn."""
        if not remaining:
            closing = "{}" if opening == "{" else "}"
            return closing if self.feed(closing) is not None else None
        for index, (key, item) in enumerate(remaining):
            head = f"{opening}{json.dumps(key, ensure_ascii=self.ensure_ascii)}: "
            start = len(self.tokens)
            if self.feed(head) is None:
                continue
            text = self.value(item)
            rest = None if text is None else self.members(remaining[:index] + remaining[index + 1:], ", ")
            if rest is not None:
                return head + text + rest
            self.undo(len(self.tokens) - start)
        return None


def accepts_text(compiled: CompiledGrammar, encode: Callable[[str], list[int]], text: str, stop: int) -> bool:
    matcher = compiled.matcher()
    return all(matcher.accept(token) for token in encode(text)) and matcher.accept(stop) and matcher.is_terminated()


def cached_encoder(tokenizer) -> Callable[[str], list[int]]:
    """The tokenizer's own ids for a text (no special tokens), memoized: the search feeds the same keys and
    punctuation thousands of times."""
    fast = tokenizer.backend_tokenizer
    return functools.lru_cache(maxsize=200_000)(lambda text: tuple(fast.encode(text, add_special_tokens=False).ids))


def accepts(compiled: CompiledGrammar, encode: Callable[[str], list[int]], value: Any, stop: int) -> bool:
    """Some serialization of `value`, tokenized whole, drives a fresh matcher to termination."""
    # With and without \u escapes for non-ASCII characters, when the value has any.
    escapes = (False, True) if json.dumps(value, ensure_ascii=False) != json.dumps(value) else (False,)
    for ensure_ascii in escapes:
        if accepts_text(compiled, encode, json.dumps(value, ensure_ascii=ensure_ascii), stop):
            return True
        text = Search(compiled, encode, ensure_ascii).value(value)
        if text is not None and accepts_text(compiled, encode, text, stop):
            return True
    return False


@dataclass
class Verdict:
    """One schema's outcome: "ok", or what went wrong."""

    outcome: str
    detail: str = ""
    exact: bool = False  # the grammar judged said it enforces the schema exactly
    valid_accepted: int = 0
    invalid_rejected: int = 0
    wrongly_accepted: list[int] = field(default_factory=list)  # indices of invalid instances accepted

    @property
    def gap(self) -> bool:
        return self.outcome != "ok"


def judge(compiled: CompiledGrammar, encode: Callable[[str], list[int]], tests: list[dict], stop: int) -> Verdict:
    verdict = Verdict("ok", "; ".join(compiled.fidelity.approximations), compiled.fidelity.exact)
    valid_rejected = False
    for index, test in enumerate(tests):
        accepted = accepts(compiled, encode, test["data"], stop)
        if test["valid"]:
            verdict.valid_accepted += accepted
            valid_rejected |= not accepted
        elif accepted:
            verdict.wrongly_accepted.append(index)
        else:
            verdict.invalid_rejected += 1
    problems = ["valid rejected"] * valid_rejected + ["invalid accepted"] * bool(verdict.wrongly_accepted)
    verdict.outcome = ", ".join(problems) or "ok"
    return verdict
