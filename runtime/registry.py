"""Named choices by kind (attention backends, grammar backends, scheduling policies, ...): the one list that
config validation, CLI `choices` and backend construction all read.

A kind is named after the EngineArgs/ServerArgs field that picks from it. An entry may name its implementation
by import path ("package.module:attr"), so registering a backend imports nothing until it is chosen; an entry
without one is a value that other code interprets (a policy name, "auto").

A pluggable part registers its kind in a module beside its implementations, which config.py imports so validation
sees every name: attention/select.py, speculative/registry.py, disaggregation/registry.py. Grammar backends are a
table in grammars/registry.py instead (grammars/ sits below the runtime and cannot import this module); config.py
registers its names here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    name: str
    target: str | None = None


_ENTRIES: dict[str, dict[str, Entry]] = {}


def register(kind: str, name: str, target: str | None = None) -> None:
    """Add a choice; registering the same entry twice is harmless, a different one under a taken name is not."""
    entries = _ENTRIES.setdefault(kind, {})
    entry = Entry(name, target)
    if entries.get(name, entry) != entry:
        raise ValueError(f"{kind} {name!r} is already registered as {entries[name].target!r}")
    entries[name] = entry


def register_names(kind: str, names: Iterable[str]) -> None:
    for name in names:
        register(kind, name)


def is_kind(kind: str) -> bool:
    return kind in _ENTRIES


def names(kind: str) -> tuple[str, ...]:
    """The kind's choices in registration order (the order `--help` lists them)."""
    return tuple(_ENTRIES.get(kind, ()))


def is_registered(kind: str, name: str) -> bool:
    return name in _ENTRIES.get(kind, {})


def check(kind: str, name: str) -> None:
    # A list or dict where a name belongs is refused like any other wrong name (it would not even hash).
    if not isinstance(name, str) or not is_registered(kind, name):
        raise ValueError(f"{kind} must be one of {names(kind)}, got {name!r}")


def resolve(kind: str, name: str) -> Any:
    """The object the entry's import path names, imported now."""
    check(kind, name)
    target = _ENTRIES[kind][name].target
    if target is None:
        raise ValueError(f"{kind} {name!r} names no implementation to load")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
