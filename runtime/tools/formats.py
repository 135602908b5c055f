"""The tool-call formats model families emit, and which one a chat template speaks.

A call is generated piece by piece (server/answer.py): the format's fixed text is appended as is, the function
name is generated under a `choices` constraint and the arguments under the function's own JSON schema, so the
arguments are exactly what the grammar path makes of that schema. The pieces, for Hermes (Qwen2.5, Qwen3):

    <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
    `-- open ---'`prefix--'`-- name --'`-- infix ---'`---- arguments -'`-- suffix ---'

`separator` leads to the next call of a parallel batch and `close` ends the block. In `auto` mode the model writes
free text until it writes `trigger`; from there the call is generated as above. A format without a trigger
(`json`, the model-independent JSON array) serves `required` and named choices only.

Pythonic calls (`[get_weather(city="Paris")]`) are Python syntax, which no JSON grammar describes; they are parsed
from free output instead (pythonic.py) and offered only for `auto`.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

from .protocol import new_call_id

ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class CallFormat:
    name: str
    open: str
    prefix: str
    infix: str
    suffix: str
    separator: str
    close: str
    trigger: str | None  # what starts calls in free text; None: no `auto` mode
    trigger_at_start: bool = False  # the trigger counts only as the output's first non-space text (Llama 3)
    mistral_ids: bool = False  # Mistral's templates refuse call ids that are not 9 alphanumerics

    def call_id(self) -> str:
        if self.mistral_ids:
            return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))
        return new_call_id()


HERMES = CallFormat("hermes", open="<tool_call>\n", prefix='{"name": "', infix='", "arguments": ',
                    suffix="}\n</tool_call>", separator="\n<tool_call>\n", close="", trigger="<tool_call>")
LLAMA3 = CallFormat("llama3_json", open="", prefix='{"name": "', infix='", "parameters": ', suffix="}",
                    separator="; ", close="", trigger="{", trigger_at_start=True)
MISTRAL = CallFormat("mistral", open="[TOOL_CALLS] [", prefix='{"name": "', infix='", "arguments": ', suffix="}",
                     separator=", ", close="]", trigger="[TOOL_CALLS]", mistral_ids=True)
# required / named on a model with no known format: a JSON array of calls, the whole answer (as vLLM does).
JSON_ARRAY = CallFormat("json", open="[", prefix='{"name": "', infix='", "parameters": ', suffix="}",
                        separator=", ", close="]", trigger=None)

FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}
PYTHONIC = "pythonic"
# --tool-call-parser names: vLLM's, and SGLang's where they differ.
ALIASES = {"qwen25": "hermes", "qwen": "hermes", "qwen3": "hermes", "llama3": "llama3_json", "llama4_pythonic":
           PYTHONIC}
PARSER_NAMES = (*FORMATS, PYTHONIC, *ALIASES)
# Text each family's chat template carries when it renders tools, most specific first.
SIGNATURES = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"),
              ('"parameters": dictionary of argument name', "llama3_json"),
              ("[func_name1(params_name1=params_value1", PYTHONIC))


def canonical(name: str) -> str:
    """The format a --tool-call-parser name stands for (ValueError for a name no format has)."""
    name = ALIASES.get(name, name)
    if name not in FORMATS and name != PYTHONIC:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSER_NAMES)}")
    return name


def detect(chat_template: str | None) -> str | None:
    """The format a chat template renders tool calls in, or None when it shows none of the known ones."""
    if not chat_template:
        return None
    return next((name for text, name in SIGNATURES if text in chat_template), None)
