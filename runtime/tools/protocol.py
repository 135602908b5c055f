"""A chat request's `tools`, `tool_choice` and tool-call history, checked and turned into typed data.

Every check raises ValueError with the field named; the route answers it with a 400. A function's `parameters`
must be a JSON schema that jsonschema's own meta-schema accepts; whether a grammar backend enforces it exactly is
the grammar path's question, asked when its arguments are generated.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from jsonschema import exceptions, validators

# OpenAI's rule for function names; it also keeps a name safe to splice into JSON text unescaped.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
# Omitting `parameters` declares a function that takes none (OpenAI's meaning): only `{}` is a valid call.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_template_tool(self) -> dict[str, Any]:
        """The OpenAI shape chat templates iterate over."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required", or "named" (then `name` is the function)
    name: str | None = None

    @property
    def calls(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: `arguments` is the JSON text it wrote (it parses and follows the schema)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tools(raw: Any) -> list[ToolFunction]:
    if not isinstance(raw, list) or not raw:
        raise ValueError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    if len(raw) > MAX_TOOLS:
        raise ValueError(f"tools may hold at most {MAX_TOOLS} functions, got {len(raw)}")
    tools = [_tool(index, item) for index, item in enumerate(raw)]
    names = [tool.name for tool in tools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ValueError(f"tools: function name {duplicate!r} is defined twice")
    return tools


def _tool(index: int, item: Any) -> ToolFunction:
    where = f"tools[{index}]"
    if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
        raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}")
    unknown = sorted(set(item) - {"type", "function"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
    function = item["function"]
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ValueError(f"{where}.function: unknown field(s) {', '.join(map(str, unknown))}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise ValueError(f"{where}.function.strict must be true or false")
    return ToolFunction(name, description, _parameters(f"{where}.function.parameters", function.get("parameters")))


def _parameters(where: str, schema: Any) -> dict[str, Any]:
    if schema is None:
        return NO_PARAMETERS
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where} must describe an object (type \"object\"), got type {schema.get('type')!r}")
    try:
        json.dumps(schema, allow_nan=False)
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as error:
        raise ValueError(f"{where} is not a valid JSON schema: {error.message}") from None
    except (ValueError, RecursionError):
        raise ValueError(f"{where} must not hold NaN or infinite numbers, or nest too deeply") from None
    return schema


def parse_tool_choice(raw: Any, tools: list[ToolFunction]) -> ToolChoice:
    """OpenAI's default: "auto" when tools are given (the route passes "none" when there are none)."""
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(CHOICE_MODES)} or a named function, got {raw!r}")
        return ToolChoice(raw)
    function = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or set(raw) != {"type",
                                                                                                  "function"}:
        raise ValueError("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if function["name"] not in {tool.name for tool in tools}:
        raise ValueError(f"tool_choice names function {function['name']!r}, which is not among the tools")
    return ToolChoice("named", function["name"])


def history_arguments(arguments: str, where: str) -> Any:
    """An assistant tool call's arguments from the history, as the object chat templates expect (they render it
    with `tojson`); the client sends it as JSON text."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        raise ValueError(f"{where}.function.arguments must be JSON text") from None
