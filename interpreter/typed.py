"""Typed reads: `state.get(name)` parses a variable into the type its gen declared (or one given)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from ..lang.dtypes import DTYPE_REGEX, parse_dtype


def parse_value(value: Any, output_type: Any) -> Any:
    """int/float/bool/str dtypes, a pydantic model class, or a JSON schema (dict or string); lists element-wise."""
    if isinstance(value, list):
        return [parse_value(item, output_type) for item in value]
    if output_type is None or not isinstance(value, str):
        return value
    if isinstance(output_type, type) and output_type in DTYPE_REGEX:
        return parse_dtype(output_type, value)
    if isinstance(output_type, type) and hasattr(output_type, "model_validate_json"):
        return output_type.model_validate_json(value)
    if isinstance(output_type, (dict, str)):
        data = json.loads(value)
        if output_type != "$$ANY$$":
            schema = json.loads(output_type) if isinstance(output_type, str) else output_type
            jsonschema.validate(data, schema)
        return data
    raise ValueError(f"cannot parse a variable as {output_type!r}; give int, float, bool, str, a pydantic model "
                     f"or a JSON schema")
