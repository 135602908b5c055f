"""The tool-call pieces without a model: tool definitions and choices checked, formats detected from the real chat
templates, --tool-call-parser names, and the pythonic parser on well- and ill-formed calls."""

from __future__ import annotations

import json

import pytest

from furcate.runtime.config import ServerArgs
from furcate.runtime.model.weights.default_model import prepare_default_model
from furcate.runtime.tools.formats import FORMATS, JSON_ARRAY, canonical, detect
from furcate.runtime.tools.protocol import NO_PARAMETERS, ToolChoice, parse_tool_choice, parse_tools
from furcate.runtime.tools.pythonic import parse_pythonic
from tiny_models import TEMPLATES

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}
TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
                     {"type": "function", "function": {"name": "ping"}}])


def test_tools_and_choices():
    assert [t.name for t in TOOLS] == ["get_weather", "ping"] and TOOLS[1].parameters == NO_PARAMETERS
    assert TOOLS[0].as_template_tool() == {"type": "function", "function": {"name": "get_weather",
                                                                            "parameters": CITY}}
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice("required", TOOLS) == ToolChoice("required")
    assert parse_tool_choice({"type": "function", "function": {"name": "ping"}}, TOOLS) == ToolChoice("named", "ping")
    for bad, match in ((["x"], "tools\\[0\\]"), ([], "non-empty"),
                       ([{"type": "function", "function": {"name": "a" * 65}}], "name"),
                       ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
                        "object"),
                       ([{"type": "function", "function": {"name": "f", "description": 3}}], "description")):
        with pytest.raises(ValueError, match=match):
            parse_tools(bad)
    for bad in ({"type": "function"}, {"type": "function", "function": {"name": "nope"}}, "always", 7):
        with pytest.raises(ValueError, match="tool_choice"):
            parse_tool_choice(bad, TOOLS)


def test_formats_detected_from_real_templates():
    found = {family: detect((TEMPLATES / f"{family}.jinja").read_text())
             for family in ("qwen2.5", "qwen3", "llama3.1", "mistral")}
    assert found == {"qwen2.5": "hermes", "qwen3": "hermes", "llama3.1": "llama3_json", "mistral": "mistral"}
    default_template = (prepare_default_model() / "chat_template.jinja").read_text()
    assert detect(default_template) is None and detect(None) is None
    assert canonical("qwen25") == "hermes" and canonical("llama3") == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        canonical("gpt")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerArgs(tool_call_parser="gpt")
    assert ServerArgs(reasoning_parser="qwen3", tool_call_parser="mistral").reasoning_parser == "qwen3"


@pytest.mark.parametrize("fmt", [*FORMATS.values(), JSON_ARRAY])
def test_format_pieces_make_the_history_form(fmt):
    """Pieces joined around a name and arguments give what the family's template writes for a call."""
    text = fmt.open + fmt.prefix + "get_weather" + fmt.infix + '{"city": "Paris"}' + fmt.suffix + fmt.close
    body = text[len(fmt.open): len(text) - len(fmt.suffix) - len(fmt.close)] + fmt.suffix.split("\n")[0]
    call = json.loads(body)
    assert call["name"] == "get_weather" and call.get("arguments", call.get("parameters")) == {"city": "Paris"}
    assert fmt.trigger is None or fmt.open.startswith(fmt.trigger) or fmt.trigger_at_start
    ids = {fmt.call_id() for _ in range(5)}
    assert len(ids) == 5 and all(len(i) == 9 and i.isalnum() for i in ids) == fmt.mistral_ids


def test_pythonic_calls():
    assert parse_pythonic('[get_weather(city="Paris", days=2), ping()]', TOOLS) == [
        ("get_weather", '{"city": "Paris", "days": 2}'), ("ping", "{}")]
    assert parse_pythonic(' [get_weather(city="Oslo")]\n', TOOLS) == [("get_weather", '{"city": "Oslo"}')]
    for text in ("get_weather(city='x')", "[get_weather(days=1)]", "[get_weather(city=3)]", "[unknown()]",
                 "[get_weather('Paris')]", "[__import__('os').system('x')]", "[get_weather(city=open('f'))]",
                 "[]", "[ping(), 1]", "[ping(x=1)]", "[" * 5000 + "]" * 5000, "[ping(a=float('nan'))]"):
        assert parse_pythonic(text, TOOLS) is None, text
