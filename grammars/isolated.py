"""Build an outlines-core Index in a child process under a time and memory limit.

outlines-core turns a JSON schema into a regex and a regex into a token-level DFA; for some schemas either step takes
minutes and tens of GB. A thread cannot stop a compile that is inside Rust, so both run in a process that can be
killed. The child is this file run as a script: it imports only outlines_core, and schema_keywords.py and
formats.py beside it (no torch, no furcate, which is also why it reads /proc itself rather than sharing the runtime's
helper), so it starts in ~30 ms, and it is a fresh interpreter, so neither the scheduler's threads nor a user's
unguarded script are forked or re-run. The child also finds how the schema's regex departs from the schema, as that
converts the schema again.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
from collections.abc import Callable
from typing import Any


class CompileLimitExceeded(ValueError):
    """The compile ran out of time or memory; a ValueError so it fails its request like any bad spec."""


def build_index_isolated(kind: str, source: str, vocabulary, timeout_s: float, memory_limit_bytes: int):
    """outlines_core.Index for a regex or a JSON schema (`kind` "regex" or "json_schema"), built in a child.
    Raises CompileLimitExceeded past either limit and ValueError when outlines-core rejects the source."""
    return compile_isolated(kind, source, vocabulary, timeout_s, memory_limit_bytes)[0]


def compile_isolated(kind: str, source: str, vocabulary, timeout_s: float,
                     memory_limit_bytes: int) -> tuple[object, tuple[str, ...]]:
    """build_index_isolated's Index, and for a JSON schema the keywords and defaults its regex departs from."""
    request = pickle.dumps((memory_limit_bytes, kind, source, vocabulary))
    try:
        done = subprocess.run([sys.executable, "-I", __file__], input=request, capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:  # run() has killed the child
        raise CompileLimitExceeded(f"did not compile within {timeout_s:g}s") from None
    limit = f"{memory_limit_bytes / 2**30:g} GiB"
    if done.returncode != 0:  # Rust's allocator aborts when the address-space limit is hit
        raise CompileLimitExceeded(f"the compile process died, most likely past its {limit} memory limit")
    ok, value = pickle.loads(done.stdout)
    if ok:
        return value
    if value == "MemoryError":
        raise CompileLimitExceeded(f"compiling needed more than {limit} of memory")
    raise ValueError(value)


def _virtual_memory_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read VmSize from /proc/self/status")


def _approximations(schema: Any) -> tuple[str, ...]:
    from formats import format_departures
    from outlines_core.json_schema import build_regex_from_schema
    from schema_keywords import (
        closed_by_default,
        ignored_keywords,
        one_of_as_any_of,
        pattern_features,
        unanchored_patterns,
    )

    # outlines-core's regex for an object with properties is the same whatever additionalProperties says (the tests
    # pin it): always closed. So `false` is enforced, and closed_by_default names the objects it gets wrong.
    ignored = ignored_keywords(schema, build_regex_from_schema, skip=("additionalProperties",))
    # Its regex classes are Unicode, where JSON Schema's (ECMA-262) \d and \w are ASCII.
    unicode = [f"pattern {pattern[:60]!r}: \\d and \\w match any Unicode digit or letter"
               for pattern, features in pattern_features(schema).items() if features & {"digit", "word"}]
    return tuple(ignored + closed_by_default(schema, build_regex_from_schema) + one_of_as_any_of(schema)
                 + unanchored_patterns(schema) + unicode + format_departures(schema, _format_tester)
                 + _free_values(schema))


def _free_values(schema: Any) -> list[str]:
    """outlines-core's regex for a value with no schema covers only part of JSON (measured on 0.2.14, pinned by the
    tests): a `{}` property's alternation is left ungrouped, so the object around it takes nothing, and objects
    without properties and arrays without items nest only a few levels deep."""
    from schema_keywords import CONSTRAINTS, schemas_in

    shaping = set(CONSTRAINTS) | {"type", "$ref", "properties", "items"}
    for node in schemas_in(schema):
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        open_object = "object" in types and not node.get("properties")
        open_array = "array" in types and "items" not in node and "prefixItems" not in node
        if open_object or open_array or not shaping & set(node):
            return ["values without a schema ({}, objects without properties, arrays without items): outlines-core's "
                    "regex takes only part of JSON"]
    return []


def _format_tester(fmt: str) -> Callable[[str], bool] | None:
    """Whether outlines-core's regex for the format takes a string (Python's re runs it); None where outlines-core
    does not implement the format (it raises, and so does the compile)."""
    from formats import regex_accepts
    from outlines_core.json_schema import build_regex_from_schema

    try:
        regex = build_regex_from_schema(json.dumps({"type": "string", "format": fmt}))
    except Exception:  # noqa: BLE001 - an unknown format
        return None
    return lambda text: regex_accepts(regex, json.dumps(text))


def _child() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this folder off sys.path
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema
    from rewrites import equivalent_schema

    memory_limit_bytes, kind, source, vocabulary = pickle.loads(sys.stdin.buffer.read())
    # On top of what the interpreter already maps, so the limit bounds the compile's own allocations.
    limit = _virtual_memory_bytes() + memory_limit_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        schema = equivalent_schema(json.loads(source)) if kind == "json_schema" else None
        regex = source if schema is None else build_regex_from_schema(json.dumps(schema))
        index = Index(regex, vocabulary)
        result = (True, (index, () if schema is None else _approximations(schema)))
    except MemoryError:
        result = (False, "MemoryError")
    except Exception as error:  # noqa: BLE001 - outlines-core's rejection, named, goes back to the caller
        result = (False, f"{type(error).__name__}: {error}")
    sys.stdout.buffer.write(pickle.dumps(result))


if __name__ == "__main__":
    _child()
