"""What a request may be constrained to, as plain data: importable without torch (the language uses it).

The bitmask and matcher code that needs torch lives in base.py beside this file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "regex", "ebnf", "choices")
# SGLang's spelling of "any JSON value" (OpenAI's response_format json_object).
ANY_JSON = "$$ANY$$"


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to. `spec` is a string so specs hash, pickle and key the compile cache."""

    kind: str
    spec: str

    @classmethod
    def from_params(cls, json_schema: Any = None, regex: str | None = None, ebnf: str | None = None,
                    choices: list[str] | None = None) -> GrammarSpec | None:
        given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf),
                                   ("choices", choices)) if v is not None}
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex, ebnf, choices; got {sorted(given)}")
        kind, value = next(iter(given.items()))
        return cls(kind, normalize(kind, value))


def normalize(kind: str, value: Any) -> str:
    if kind == "json_schema":
        if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
            value = value.model_json_schema()
        if isinstance(value, dict):
            try:
                return json.dumps(value, allow_nan=False)
            except RecursionError:
                raise ValueError("json_schema is nested too deeply") from None
            except ValueError:
                raise ValueError("json_schema must not contain NaN or infinite numbers") from None
        if not isinstance(value, str):
            raise ValueError(f"json_schema must be a dict, a JSON string or a pydantic model, got {type(value)}")
        if value != ANY_JSON:
            try:
                json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"json_schema is not valid JSON: {error}") from None
            except RecursionError:
                raise ValueError("json_schema is nested too deeply") from None
        return value
    if kind == "choices":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        return json.dumps(list(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string")
    return value
