"""Pythonic tool calls (Llama 3.2/4 and others): the answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time(zone="CET")]`, read with `ast` (never evaluated)."""

from __future__ import annotations

import ast
import json
from typing import Any

from jsonschema import validators

from .protocol import ToolFunction

# Python literals as JSON values: what the arguments of a call may be.
LITERALS = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.UnaryOp)


def parse_pythonic(text: str, tools: list[ToolFunction]) -> list[tuple[str, str]] | None:
    """(name, JSON arguments) per call when `text` is a list of calls of known functions whose arguments follow
    their schemas; None otherwise (the text is then the answer's content)."""
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return None
    try:
        tree = ast.parse(stripped, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    schemas = {tool.name: tool.parameters for tool in tools}
    calls = [_call(node, schemas) for node in tree.elts]
    return None if any(call is None for call in calls) else calls  # type: ignore[return-value]


def _call(node: ast.expr, schemas: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if node.func.id not in schemas or any(k.arg is None or not isinstance(k.value, LITERALS) for k in node.keywords):
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    schema = schemas[node.func.id]
    if not validators.validator_for(schema)(schema).is_valid(json.loads(text)):
        return None
    return node.func.id, text
