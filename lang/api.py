"""The functions programs are written with: gen, select, roles, images. Each returns an expression."""

from __future__ import annotations

from typing import Any

from ..grammars.spec import GrammarSpec
from .choices import ChoicesMethod, token_length_normalized
from .dtypes import DTYPE_REGEX, resolve_dtype
from .ir import Concat, Expr, Gen, Image, RoleBegin, RoleEnd, Select, SeparateReasoning, Video, as_expr

ROLES = ("system", "user", "assistant")


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: Any = None, choices: list[str] | None = None,
        choices_method: ChoicesMethod | None = None, regex: str | None = None, json_schema: Any = None,
        ebnf: str | None = None) -> Expr:
    """Generate into variable `name`. A field left at None inherits the default passed to run().

    `choices` makes it a select; `dtype` (int, float, bool, str) and `regex`, `json_schema` (a dict, a JSON
    string or a pydantic model) or `ebnf` constrain the output.
    """
    _check_name(name)
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if dtype is not None:
        if regex is not None or json_schema is not None or ebnf is not None:
            raise ValueError("give dtype or one of regex, json_schema, ebnf, not both")
        dtype = resolve_dtype(dtype)
        regex = DTYPE_REGEX[dtype]
    sampling = {key: value for key, value in (
        ("max_new_tokens", max_tokens), ("min_new_tokens", min_tokens), ("n", n), ("stop", stop),
        ("stop_token_ids", stop_token_ids), ("stop_regex", stop_regex), ("temperature", temperature),
        ("top_p", top_p), ("top_k", top_k), ("min_p", min_p), ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty), ("ignore_eos", ignore_eos)) if value is not None}
    logprobs = {key: value for key, value in (
        ("return_logprob", return_logprob), ("logprob_start_len", logprob_start_len),
        ("top_logprobs_num", top_logprobs_num), ("return_text_in_logprobs", return_text_in_logprobs))
        if value is not None}
    constraint = GrammarSpec.from_params(json_schema=json_schema, regex=regex, ebnf=ebnf)
    return Gen(name, sampling, logprobs, constraint, dtype if dtype is not None else json_schema)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """gen(name, dtype=int, ...): an optionally signed integer; `state.get(name)` returns an int."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """gen(name, dtype=str, ...): a double-quoted string; `state.get(name)` returns it unquoted."""
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized) -> Expr:
    """Append exactly one of `choices`, picked by scoring each as a continuation (see lang/choices.py)."""
    _check_name(name)
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"select needs a non-empty list of choices, got {choices!r}")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices must be non-empty strings, got {choices!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < 1e6:
        raise ValueError(f"select temperature must be a number in [0, 1e6), got {temperature!r}")
    if not callable(choices_method) or not hasattr(choices_method, "requires_unconditional"):
        raise ValueError(f"choices_method must be one of furcate's choice methods, got {choices_method!r}")
    return Select(name, tuple(choices), float(temperature), choices_method)


def separate_reasoning(expr: Expr | None = None, model_type: str | None = None) -> Expr:
    """SGLang's frontend call: after `expr` (a named gen) runs, its variable holds the answer and
    `<name>_reasoning_content` the model's think block. `model_type` names the reasoning parser: "deepseek-r1"
    (reasoning until `</think>`) or "qwen3" (reasoning only inside an opened block); it is checked when it runs."""
    if not isinstance(expr, Gen) or expr.name is None:
        raise ValueError(f"separate_reasoning takes a named gen, got {expr!r}")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"separate_reasoning needs model_type (a reasoning parser's name), got {model_type!r}")
    return SeparateReasoning(expr, model_type)


def image(source: Any) -> Expr:
    """An image for a vision-language model: a path, a data: or http(s) URL, base64, encoded bytes or a PIL image
    (checked when it is sent)."""
    if isinstance(source, (str, bytes)) and not source or source is None:
        raise ValueError("image takes a non-empty path, URL, base64 string, bytes or a PIL image")
    return Image(source)


def video(source: str, num_frames: int) -> Expr:
    if not isinstance(source, str) or not source:
        raise ValueError("video takes a non-empty path")
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}")
    return Video(source, num_frames)


def role(name: str, expr: Any = None) -> Expr:
    """The role's begin and end around `expr` (an empty turn when None)."""
    if name not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {name!r}")
    if expr is None:
        return Concat((RoleBegin(name), RoleEnd(name)))
    return Concat((RoleBegin(name), as_expr(expr), RoleEnd(name)))


def system(expr: Any = None) -> Expr:
    return role("system", expr)


def user(expr: Any = None) -> Expr:
    return role("user", expr)


def assistant(expr: Any = None) -> Expr:
    return role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def _check_name(name: Any) -> None:
    if name is not None and not isinstance(name, str):
        raise ValueError(f"a variable name must be a string or None, got {name!r}")
