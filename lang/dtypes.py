"""`gen(dtype=...)`: each type is a regex the output must match, and a parser for `state.get(name)`."""

from __future__ import annotations

from typing import Any

INT_REGEX = r"[-+]?[0-9]+"
FLOAT_REGEX = r"[-+]?[0-9]+(\.[0-9]+)?"
BOOL_REGEX = r"(True|False)"
# A double-quoted string without quotes, backslashes or line breaks inside (SGLang's gen_string is quoted too).
STRING_REGEX = r'"[^"\\\n]*"'

DTYPE_REGEX = {int: INT_REGEX, float: FLOAT_REGEX, bool: BOOL_REGEX, str: STRING_REGEX}
DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}


def resolve_dtype(dtype: Any) -> type:
    """Accept the type or its name; anything else is a clear error."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if dtype in DTYPE_REGEX:
        return dtype
    raise ValueError(f"dtype must be one of int, float, bool, str; got {dtype!r}")


def parse_dtype(dtype: type, text: str) -> Any:
    """The value a dtype gen's text stands for; ValueError when the text does not match."""
    text = text.strip()
    if dtype is bool:
        if text not in ("True", "False"):
            raise ValueError(f"expected True or False, got {text!r}")
        return text == "True"
    if dtype is str:
        if len(text) < 2 or text[0] != '"' or text[-1] != '"':
            raise ValueError(f"expected a double-quoted string, got {text!r}")
        return text[1:-1]
    return dtype(text)
