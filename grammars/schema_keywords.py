"""Find how a JSON-schema backend departs from a schema, by trying: convert the schema with and without each
constraint keyword, and when the backend's output (its grammar or regex text) does not change, it ignored the keyword;
likewise with every open object closed. Also: the patterns a whole-string matcher gets wrong, and the regex
constructs whose meaning differs between dialects.

Standard library only, with no package-relative imports: the outlines compile child (isolated.py) imports this file by
path, so that it starts without torch or furcate.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

try:  # the parser behind `re`, which tells a pattern's top-level structure
    from re import _parser as regex_parser  # Python 3.11+
except ImportError:  # pragma: no cover - older Pythons
    import sre_parse as regex_parser

# Keywords whose value is a schema, a list of schemas, or a map from names to schemas.
SUBSCHEMA = ("not", "if", "then", "else", "additionalItems", "contains", "additionalProperties", "propertyNames",
             "unevaluatedItems", "unevaluatedProperties", "items")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
# Keywords that constrain instances (JSON Schema's validation and applicator vocabularies). `$ref`, `properties`,
# `items` and `type` stay out: every backend builds its grammar from them, and removing one changes everything.
CONSTRAINTS = ("enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
               "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains",
               "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "dependencies",
               "dependentSchemas", "format", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "prefixItems",
               "additionalItems", "contains", "patternProperties", "additionalProperties", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")
# Values that constrain nothing, so a backend that ignores them loses nothing.
NO_OPS = {"minLength": (0,), "minItems": (0,), "minProperties": (0,), "uniqueItems": (False,), "required": ([],),
          "additionalProperties": (True, {}), "additionalItems": (True, {}), "exclusiveMinimum": (False,),
          "exclusiveMaximum": (False,), "unevaluatedProperties": (True, {}), "unevaluatedItems": (True, {})}
# JSON Schema's own value for keywords a backend may default differently (closing objects, say).
SPEC_DEFAULTS = {"additionalProperties": True, "additionalItems": True, "unevaluatedProperties": True,
                 "unevaluatedItems": True}
# Keywords that only describe: a subschema made of these and nothing else constrains nothing.
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                         "writeOnly", "$id"})
# Stands in for a format to learn how the backend treats a format it does not know.
UNKNOWN_FORMAT = "furcate-unknown-format"


def schemas_in(schema: Any) -> Iterator[dict]:
    """Every (sub)schema object, the root included; data (enum, const, default, examples) is never entered."""
    if not isinstance(schema, dict):
        return
    yield schema
    for keyword in SUBSCHEMA:
        yield from schemas_in(schema.get(keyword))
    for keyword in SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for item in schema[keyword]:
                yield from schemas_in(item)
    for keyword in SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for item in schema[keyword].values():
                yield from schemas_in(item)


def constraint_uses(schema: Any) -> list[tuple[str, str | None]]:
    """The distinct (keyword, format name or None) pairs the schema uses with an effect, in first-use order."""
    uses: dict[tuple[str, str | None], None] = {}
    for node in schemas_in(schema):
        for keyword in CONSTRAINTS:
            if keyword in node and not is_no_op(keyword, node[keyword]):
                uses[(keyword, node[keyword] if keyword == "format" else None)] = None
    return list(uses)


def is_no_op(keyword: str, value: Any) -> bool:
    # Type-strict: `exclusiveMinimum: 0` (draft 6) is a bound, though 0 == False.
    return any(type(value) is type(no_op) and value == no_op for no_op in NO_OPS.get(keyword, ()))


def without(schema: Any, keyword: str, fmt: str | None = None) -> Any:
    """A copy of `schema` where `keyword` constrains nothing in any subschema: set to JSON Schema's default where a
    backend's default may differ (one that closes objects by default reads a missing additionalProperties as false),
    removed otherwise. A format is replaced by an unknown one (backends spell an unknown format differently from
    none)."""
    result = copy.deepcopy(schema)
    for node in schemas_in(result):
        if keyword == "format":
            if node.get("format") == fmt:
                node["format"] = UNKNOWN_FORMAT
        elif keyword in node and keyword in SPEC_DEFAULTS:
            node[keyword] = SPEC_DEFAULTS[keyword]
        else:
            node.pop(keyword, None)
    return result


def ignored_keywords(schema: Any, convert: Callable[[str], str], skip: tuple[str, ...] = ()) -> list[str]:
    """Keywords whose removal leaves `convert`'s output (the backend's grammar or regex text) unchanged, except those
    in `skip`, which the caller judges otherwise."""
    baseline = convert(json.dumps(schema))
    ignored = []
    for keyword, fmt in constraint_uses(schema):
        if keyword in skip:
            continue
        try:
            changed = convert(json.dumps(without(schema, keyword, fmt))) != baseline
        except Exception:  # noqa: BLE001 - any failure of the altered schema means the keyword mattered
            changed = True
        if changed:
            continue
        if keyword == "format":
            ignored.append(f"format {fmt!r}: not enforced")
        elif keyword in SPEC_DEFAULTS:  # the same grammar for false and true: one of them is not honoured
            ignored.append(f"{keyword}: the grammar is the same whatever its value")
        else:
            ignored.append(f"{keyword}: not enforced")
    return ignored


def closed_by_default(schema: Any, convert: Callable[[str], str]) -> list[str]:
    """JSON Schema allows properties an object schema does not list unless it says `additionalProperties: false`; a
    backend whose output does not change when every object that allows them says false instead refuses them."""
    closed = copy.deepcopy(schema)
    open_objects = [node for node in schemas_in(closed) if isinstance(node.get("properties"), dict)
                    and node.get("additionalProperties") is not False]
    for node in open_objects:
        node["additionalProperties"] = False
    if open_objects and convert(json.dumps(closed)) == convert(json.dumps(schema)):
        return ["additionalProperties: unlisted properties are refused, though the schema allows them"]
    return []


def one_of_as_any_of(schema: Any) -> list[str]:
    """For a backend that joins oneOf's branches like anyOf's (an instance matching two is accepted; the tests pin
    which backends do): every oneOf of two or more branches is an approximation."""
    if any(isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 for node in schemas_in(schema)):
        return ["oneOf: treated as anyOf (an instance matching several branches is accepted)"]
    return []


def unanchored_patterns(schema: Any) -> list[str]:
    """Patterns a backend that matches regexes against the whole string gets wrong: JSON Schema looks for a match
    anywhere in the string, so only a pattern anchored at both ends (`^...$`) means the same whole-string match."""
    found: dict[str, None] = {}
    for node in schemas_in(schema):
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            if not anchored_at_both_ends(pattern):
                found[f"pattern {pattern[:60]!r}: matched against the whole string, not searched"] = None
    return list(found)


def anchored_at_both_ends(pattern: str) -> bool:
    try:
        items = list(regex_parser.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return False
    at = regex_parser.AT
    return (len(items) >= 2 and items[0] == (at, regex_parser.AT_BEGINNING)
            and items[-1] == (at, regex_parser.AT_END))


def regex_features(pattern: str) -> set[str]:
    """Which of "dot", "digit", "word", "space" (`.`, `\\d`/`\\D`, `\\w`/`\\W`, `\\s`/`\\S`) a regex uses: the
    constructs whose meaning differs between regex dialects (Unicode or ASCII classes; `.` with or without a
    newline). Empty when Python cannot parse it."""
    try:
        parsed = regex_parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return set()
    categories = {"CATEGORY_DIGIT": "digit", "CATEGORY_NOT_DIGIT": "digit", "CATEGORY_WORD": "word",
                  "CATEGORY_NOT_WORD": "word", "CATEGORY_SPACE": "space", "CATEGORY_NOT_SPACE": "space"}
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, (list, tuple, regex_parser.SubPattern)):
            if len(node) == 2 and node[0] is regex_parser.ANY:
                found.add("dot")
            elif len(node) == 2 and node[0] is regex_parser.CATEGORY:
                found.add(categories.get(str(node[1]), ""))
            for child in node:
                visit(child)

    visit(parsed)
    return found - {""}


def pattern_features(schema: Any) -> dict[str, set[str]]:
    """regex_features of each pattern (and patternProperties key) in the schema."""
    features: dict[str, set[str]] = {}
    for node in schemas_in(schema):
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            features[pattern] = regex_features(pattern)
    return features
