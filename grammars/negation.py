"""`not` rewritten as the positive constraints it means, so backends that cannot enforce `not` (llguidance refuses
it, xgrammar and outlines-core ignore it) get an equivalent schema they enforce exactly.

Only single-keyword negations have a positive form. A keyword that applies to one JSON type passes every other type,
so its negation also excludes those: `not: {maxLength: 3}` means a string of 4 characters or more, nothing else.
Anything without an exact positive form (`not` of an enum, a pattern, multipleOf, several keywords) stays as it is,
and the backend reports it as before. The jsonschemabench tests check the rewritten schemas against every instance.

Standard library only, with no package-relative imports: the outlines compile child imports this file by path.
"""

from __future__ import annotations

import copy
import math
from typing import Any

try:
    from .schema_keywords import ANNOTATIONS, schemas_in
except ImportError:  # run by path in the outlines compile child, with this folder on sys.path
    from schema_keywords import ANNOTATIONS, schemas_in

TYPES = ("null", "boolean", "object", "array", "number", "string")  # integer is a kind of number
# keyword -> (the type it applies to, the keyword that holds at the complement, how its value maps there)
BOUNDS = {"maximum": ("number", "exclusiveMinimum", 0), "minimum": ("number", "exclusiveMaximum", 0),
          "exclusiveMaximum": ("number", "minimum", 0), "exclusiveMinimum": ("number", "maximum", 0),
          "maxLength": ("string", "minLength", 1), "minLength": ("string", "maxLength", -1),
          "maxItems": ("array", "minItems", 1), "minItems": ("array", "maxItems", -1),
          "maxProperties": ("object", "minProperties", 1), "minProperties": ("object", "maxProperties", -1)}


def without_negations(schema: Any) -> Any:
    """A copy of the schema with each `not` that has an exact positive form replaced by it."""
    result = copy.deepcopy(schema)
    if not isinstance(result, dict) or _old_draft(result):  # draft 4's exclusive bounds are booleans
        return result
    for node in schemas_in(result):
        positive = complement(node["not"]) if "not" in node else None
        if positive is not None:
            merged = merge(node, positive)
            if merged is not None:
                node.clear()
                node.update(merged)
    return result


def complement(negated: Any) -> dict | None:
    """The positive constraints equivalent to `not: negated`, or None when there is no exact one."""
    if negated is False:
        return {}
    if not isinstance(negated, dict):
        return None
    keywords = {key: value for key, value in negated.items() if key not in ANNOTATIONS}
    if "properties" in keywords and all(value in ({}, True) for value in keywords["properties"].values()):
        del keywords["properties"]  # properties that allow anything constrain nothing
    if len(keywords) != 1:
        return None
    (keyword, value), = keywords.items()
    if keyword == "type":
        return _other_types(value)
    if keyword == "not":  # a double negation
        return value if isinstance(value, dict) else {} if value is True else None
    if keyword in BOUNDS and _is_number(value):
        kind, opposite, shift = BOUNDS[keyword]
        bound = value + shift
        return None if shift and bound < 0 else {"type": kind, opposite: bound}
    if keyword == "allOf" and isinstance(value, list) and value and all(_only_required(part) for part in value):
        keyword, value = "required", [key for part in value for key in part["required"]]
    if keyword == "required" and isinstance(value, list) and value and all(isinstance(k, str) for k in value):
        lacks = [{"properties": {key: False}} for key in dict.fromkeys(value)]
        return {"type": "object", **(lacks[0] if len(lacks) == 1 else {"anyOf": lacks})}
    return None


def merge(node: dict, positive: dict) -> dict | None:
    """`node` without its `not` and with `positive` added, or None where they would collide."""
    merged = {key: value for key, value in node.items() if key != "not"}
    for key, value in positive.items():
        if key == "type":
            types = _intersect(merged.get("type"), value)
            if not types:
                return None
            merged["type"] = types[0] if len(types) == 1 else types
        elif key == "properties" and isinstance(merged.get("properties", {}), dict):
            merged["properties"] = {**merged.get("properties", {}), **value}
        elif key in merged:
            return None
        else:
            merged[key] = value
    return merged


def _other_types(value: Any) -> dict | None:
    named = [value] if isinstance(value, str) else value
    if not isinstance(named, list) or not all(name in TYPES + ("integer",) for name in named):
        return None
    if "integer" in named and "number" not in named:  # "a number that is not an integer" has no type of its own
        return None
    return {"type": [name for name in TYPES if name not in named]}


def _intersect(existing: Any, allowed: str | list[str]) -> list[str]:
    allowed = [allowed] if isinstance(allowed, str) else allowed
    if existing is None:
        return list(allowed)
    existing = [existing] if isinstance(existing, str) else existing
    return [name for name in existing if name in allowed or (name == "integer" and "number" in allowed)]


def _only_required(schema: Any) -> bool:
    return (isinstance(schema, dict) and set(schema) - ANNOTATIONS == {"required"}
            and isinstance(schema["required"], list))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _old_draft(root: dict) -> bool:
    return isinstance(root.get("$schema"), str) and any(f"draft-0{n}" in root["$schema"] for n in (3, 4))
