"""`oneOf` rewritten as `anyOf` where its branches provably exclude each other, so backends that can only treat
oneOf as anyOf (llguidance, outlines-core, xgrammar short of its own proof) enforce it exactly.

Two branches exclude each other when no value can match both: their JSON types differ (from `type`, `const` or
`enum`), or both are objects that require a property whose `const`/`enum` values differ (a discriminator). A oneOf of
branches that each only require one property ({"required": ["a"]}, {"required": ["b"]}) becomes "an object with
exactly one of them". Local `$ref`s are followed. Anything else stays as it is and the backend reports it.

Standard library only, with no package-relative imports: the outlines compile child imports this file by path.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

try:
    from .schema_keywords import ANNOTATIONS, schemas_in
except ImportError:  # run by path in the outlines compile child, with this folder on sys.path
    from schema_keywords import ANNOTATIONS, schemas_in

# JSON types as disjoint atoms: an integer is a number, so "number" is both of its atoms.
ATOMS = {"null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"}, "string": {"string"},
         "integer": {"int"}, "number": {"int", "frac"}}
MAX_REF_HOPS = 16


def disjoint_one_of(schema: Any) -> Any:
    """A copy of the schema with each provably exclusive oneOf written as the anyOf it equals."""
    result = copy.deepcopy(schema)
    if not isinstance(result, dict):
        return result
    for node in schemas_in(result):
        branches = node.get("oneOf")
        if not isinstance(branches, list) or "anyOf" in node:
            continue
        exactly_one = _exactly_one_property(branches)
        if exactly_one is not None:
            node.pop("oneOf")
            node["anyOf"] = exactly_one
        elif all(_exclusive(a, b, result) for a, b in itertools.combinations(branches, 2)):
            node["anyOf"] = node.pop("oneOf")
    return result


def _exactly_one_property(branches: list) -> list[dict] | None:
    """For branches that each only require one distinct property: each branch as "this one and none of the others"
    (objects only: a non-object matches every such branch, so the oneOf refuses it)."""
    keys = []
    for branch in branches:
        if not isinstance(branch, dict) or set(branch) - ANNOTATIONS != {"required"}:
            return None
        required = branch["required"]
        if not (isinstance(required, list) and len(required) == 1 and isinstance(required[0], str)):
            return None
        keys.append(required[0])
    if len(set(keys)) != len(keys) or len(keys) < 2:
        return None
    return [{"type": "object", "required": [key], "properties": {other: False for other in keys if other != key}}
            for key in keys]


def _exclusive(a: Any, b: Any, root: dict) -> bool:
    a, b = _resolve(a, root), _resolve(b, root)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a is False or b is False
    atoms_a, atoms_b = _atoms(a), _atoms(b)
    if atoms_a is not None and atoms_b is not None and not atoms_a & atoms_b:
        return True
    return _discriminated(a, b, root)


def _atoms(schema: dict) -> set[str] | None:
    """The JSON type atoms a schema's values may have; None when it does not say."""
    if "const" in schema:
        return {_atom(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_atom(value) for value in schema["enum"]}
    named = schema.get("type")
    named = [named] if isinstance(named, str) else named
    if isinstance(named, list) and all(name in ATOMS for name in named):
        return set().union(*(ATOMS[name] for name in named))
    return None


def _atom(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "int" if float(value).is_integer() else "frac"
    return {dict: "object", list: "array", str: "string"}[type(value)]


def _discriminated(a: dict, b: dict, root: dict) -> bool:
    """Both require a property whose allowed values (const or enum) share none, and one is an object: `required`
    passes every non-object, so two branches that both allow them overlap there."""
    if _atoms(a) != {"object"} and _atoms(b) != {"object"}:
        return False
    for name in set(_required(a)) & set(_required(b)):
        values_a = _values(_resolve(a.get("properties", {}).get(name), root))
        values_b = _values(_resolve(b.get("properties", {}).get(name), root))
        if values_a is not None and values_b is not None and not values_a & values_b:
            return True
    return False


def _required(schema: dict) -> list:
    return schema["required"] if isinstance(schema.get("required"), list) else []


def _values(schema: Any) -> set[str] | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {_canonical(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_canonical(value) for value in schema["enum"]}
    return None


def _canonical(value: Any) -> str:
    # 1 and 1.0 are the same JSON Schema value.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


def _resolve(schema: Any, root: dict) -> Any:
    """The schema a local `$ref` (alone) points to; the schema itself otherwise, or None when a ref cannot be
    followed."""
    for _ in range(MAX_REF_HOPS):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        if set(schema) - ANNOTATIONS != {"$ref"} or not schema["$ref"].startswith("#/"):
            return None
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        schema = target
    return None
