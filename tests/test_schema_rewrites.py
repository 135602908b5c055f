"""The schema rewrites backends compile (grammars/rewrites.py) are equivalent to the user's schema: jsonschema gives
every sample value the same verdict under both. The jsonschemabench tests check them again through the matchers."""

from __future__ import annotations

import jsonschema
import pytest

from furcate.grammars.rewrites import equivalent_schema

SAMPLES = [None, True, False, 0, 1, 2.5, 299, 300, 301, -1, "", "a", "abcd", "2024-02-29", [], [1], [1, "x"], {},
           {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"kind": "circle", "r": 1}, {"kind": "square", "side": 2},
           {"kind": "circle"}, {"x": None}]

REWRITTEN = [
    {"not": {"type": "number"}},
    {"not": {"type": ["string", "null"]}},
    {"type": ["integer", "string"], "not": {"type": "number"}},
    {"not": {"maximum": 300}},
    {"not": {"exclusiveMinimum": 0}},
    {"not": {"maxLength": 3}},
    {"not": {"minLength": 1}},
    {"not": {"minItems": 1}},
    {"not": {"maxProperties": 0}},
    {"not": {"required": ["a"]}},
    {"not": {"required": ["a", "b"]}},
    {"not": {"required": ["a"], "properties": {"a": {}, "b": {}}, "description": "no a"}},
    {"properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}},
    {"not": {"not": {"type": "string"}}},
    {"not": False},
    {"type": "string", "format": "phone-number"},
    {"not": {"allOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}},
    {"anyOf": [{"type": "object"}, {"type": "integer"}], "dependentRequired": {"a": ["b"], "b": [], "kind": ["a"]}},
    {"allOf": [{"enum": [300]}, {"not": {"not": {"maximum": 300}}}]},
    {"oneOf": [{"type": "string"}, {"type": "null"}]},
    {"oneOf": [{"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b"]}]},
    {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"type": "object", "oneOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/square"}],
     "$defs": {"circle": {"type": "object", "properties": {"kind": {"const": "circle"}}, "required": ["kind", "r"]},
               "square": {"type": "object", "properties": {"kind": {"enum": ["square"]}}, "required": ["kind"]}}},
]
LEFT_ALONE = [
    {"not": {"enum": [1, 2]}},  # no positive form
    {"not": {"type": "integer"}},  # "a number that is not an integer" has no type
    {"not": {"maxLength": 3, "pattern": "a"}},  # several keywords
    {"$schema": "http://json-schema.org/draft-04/schema#", "not": {"maximum": 3}},  # draft 4's exclusive bounds
    {"type": "string", "not": {"type": "string"}},  # nothing left to allow
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # 1 is both
    {"oneOf": [{"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
               {"properties": {"kind": {"const": "b"}}, "required": ["kind"]}]},  # a string matches both
    {"oneOf": [{"$ref": "https://example.com/x"}, {"type": "null"}]},  # a remote ref is never followed
    {"type": "string", "format": "email"},  # a format JSON Schema defines
    {"$schema": "http://json-schema.org/draft-07/schema#",
     "dependencies": {"a": {"required": ["b"]}}},  # a dependency on a schema
    {"dependencies": {"a": ["b"]}},  # 2020-12 (named by no $schema) does not define dependencies
]


def validator(schema: dict):
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


@pytest.mark.parametrize("schema", REWRITTEN, ids=[str(i) for i in range(len(REWRITTEN))])
def test_rewrite_is_equivalent_and_removes_the_keyword(schema):
    rewritten = equivalent_schema(schema)
    text = str(rewritten).replace("'", '"')
    assert not any(word in text for word in ('"not"', "oneOf", "phone-number", "dependencies", "dependentRequired"))
    for value in SAMPLES:
        assert validator(schema).is_valid(value) == validator(rewritten).is_valid(value), (value, rewritten)


@pytest.mark.parametrize("schema", LEFT_ALONE, ids=[str(i) for i in range(len(LEFT_ALONE))])
def test_no_exact_rewrite_leaves_the_schema_alone(schema):
    assert equivalent_schema(schema) == schema


def test_the_users_schema_is_not_changed():
    schema = {"not": {"type": "number"}, "properties": {"a": {"oneOf": [{"type": "string"}, {"type": "null"}]}}}
    before = repr(schema)
    equivalent_schema(schema)
    assert repr(schema) == before
