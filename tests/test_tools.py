"""Tool calls through the official `openai` client against live servers: tiny random models whose chat templates
are Qwen2.5's, Llama 3.1's and Mistral's (each family's own call format), and the default model. A random model
writes nonsense, so what these tests hold is the contract: every returned call names a given function and its
arguments parse and follow that function's schema, streamed calls assemble to the unstreamed ones, ids and finish
reasons are OpenAI's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
import requests
from transformers import AutoTokenizer

from app_thread import AppOnThread
from conftest import TINY_POOL_TOKENS, assert_server_pool_free
from furcate import Engine
from furcate.runtime.server.server_process import ServerProcess
from tiny_models import build_tiny_chat_model

FAMILIES = ("qwen2.5", "llama3.1", "mistral")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ENGINE_ARGS = {"max_total_tokens": TINY_POOL_TOKENS, "torch_num_threads": 1, "dtype": "float32"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_model_dir):
    """qwen2.5 as `furcate serve` (the agent framework's loop runs against the real command, whose flags pick the
    parsers); the other families as the same app over an engine in this process (one interpreter less to start
    per family), their parsers detected from their templates."""
    root = tmp_path_factory.mktemp("chat")
    dirs = {family: build_tiny_chat_model(family, root / family, default_model_dir) for family in FAMILIES}
    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        # SGLang's name for the format the template shows anyway: the flag's path through the CLI.
        command = pool.submit(ServerProcess, str(dirs["qwen2.5"]), ENGINE_ARGS,
                              extra_args=("--tool-call-parser", "qwen25", "--reasoning-parser", "none"))
        engines = dict(zip(FAMILIES[1:], pool.map(lambda f: Engine(str(dirs[f]), **ENGINE_ARGS), FAMILIES[1:])))
        started = {"qwen2.5": command.result(), **{f: AppOnThread(e) for f, e in engines.items()}}
    yield {family: (server, AutoTokenizer.from_pretrained(dirs[family])) for family, server in started.items()}
    for server in started.values():
        assert_server_pool_free(server.url)
        server.stop()
    for engine in engines.values():
        engine.shutdown()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(server, **kwargs):
    """One chat completion (a list of chunks when streamed)."""
    with client_of(server) as client:
        out = client.chat.completions.create(model=client.models.list().data[0].id, **kwargs)
        return list(out) if kwargs.get("stream") else out


def assert_valid_calls(message, names=tuple(SCHEMAS)) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def trigger_bias(tokenizer, family: str) -> dict[str, int]:
    """A logit bias that makes the random model open a tool call at once (its format's trigger token)."""
    trigger = {"qwen2.5": "<tool_call>", "llama3.1": "{", "mistral": "[TOOL_CALLS]"}[family]
    return {str(tokenizer.encode(trigger, add_special_tokens=False)[0]): 100}


@pytest.mark.parametrize("family", FAMILIES)
def test_required_and_named(servers, family):
    server, _ = servers[family]
    out = chat(server, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message)
    if family == "mistral":  # its template refuses any other id
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    named = chat(server, messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(named.choices[0].message, names=("get_weather",))
    assert len(named.choices[0].message.tool_calls) == 1  # a named choice is that one call, as vLLM and SGLang give
    single = chat(server, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0,
                  parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_calls_assemble_to_the_unstreamed_ones(servers, family):
    server, _ = servers[family]
    args = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    whole = chat(server, **args).choices[0].message
    with client_of(server) as client:
        model = client.models.list().data[0].id
        with client.chat.completions.stream(model=model, **args) as stream:
            final = stream.get_final_completion()
        chunks = list(client.chat.completions.create(model=model, stream=True, **args))
    assembled = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in assembled.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    firsts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls
              and c.choices[0].delta.tool_calls[0].id]
    assert [(f.index, f.type, f.function.name) for f in firsts] == \
        [(i, "function", c.function.name) for i, c in enumerate(whole.tool_calls)]
    fragments = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(fragments) > len(firsts)  # the arguments came in pieces after the first delta


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_chooses_text_or_calls(servers, family):
    server, tokenizer = servers[family]
    text = chat(server, messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0).choices[0]
    assert text.message.tool_calls is None and text.message.content
    assert text.finish_reason in ("length", "stop")
    bias = trigger_bias(tokenizer, family)
    calls = chat(server, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=120, temperature=0,
                 logit_bias=bias, parallel_tool_calls=False).choices[0]
    assert calls.finish_reason == "tool_calls" and len(calls.message.tool_calls) == 1
    assert_valid_calls(calls.message)
    streamed = chat(server, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0, logit_bias=bias,
                    parallel_tool_calls=False, stream=True)
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in streamed
                        if c.choices[0].delta.tool_calls)
    assert arguments == calls.message.tool_calls[0].function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in streamed).strip()  # no trigger leaked as text


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_results_fed_back(servers, family):
    """A conversation that renders the call and its result with the family's template, then answers."""
    server, _ = servers[family]
    first = chat(server, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0,
                 parallel_tool_calls=False).choices[0].message
    history = [*MESSAGES, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"sky": "clear"}'}]
    second = chat(server, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0).choices[0]
    assert second.message.tool_calls is None and second.message.content
    again = chat(server, messages=history, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    assert_valid_calls(again.choices[0].message)


def test_parallel_calls(servers):
    """Mistral's tiny model, biased to its trigger, goes on to a second call: both are returned, in order."""
    server, tokenizer = servers["mistral"]
    out = chat(server, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0,
               logit_bias=trigger_bias(tokenizer, "mistral")).choices[0]
    assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) >= 2
    assert len({c.id for c in out.message.tool_calls}) == len(out.message.tool_calls)
    assert_valid_calls(out.message)


def test_arguments_schema_with_refs(servers):
    """The arguments are generated under the function's own schema, as its root: its $refs resolve as written."""
    schema = {"$defs": {"unit": {"enum": ["C", "F"]}}, "type": "object", "additionalProperties": False,
              "properties": {"unit": {"$ref": "#/$defs/unit"}, "at": {"type": "string", "format": "date"}},
              "required": ["unit", "at"]}
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": schema}}]
    server, _ = servers["qwen2.5"]
    out = chat(server, messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=60, temperature=0,
               parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(out.message.tool_calls[0].function.arguments), schema,
                        format_checker=jsonschema.FormatChecker())


def test_cut_short_call_says_length(servers):
    server, _ = servers["qwen2.5"]
    out = chat(server, messages=MESSAGES, tools=TOOLS, max_tokens=3, temperature=0,
               tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert out.finish_reason == "length" and out.message.tool_calls[0].function.name == "get_weather"


def test_logprobs_of_the_generated_tokens(servers):
    """Each generated token of every part has its logprob, in order (the stop token ending each part included, as
    completion_tokens counts it); the text the format fixes was not generated and has none."""
    server, _ = servers["qwen2.5"]
    args = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0,
                logprobs=True, top_logprobs=2)
    out = chat(server, **args)
    tokens = out.choices[0].logprobs.content
    assert len(tokens) == out.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    call = out.choices[0].message.tool_calls[0].function
    assert "".join(t.token for t in tokens).replace("<|im_end|>", "") == call.name + call.arguments
    streamed = chat(server, stream=True, **args)
    assert [t.token for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
        [t.token for t in tokens]


def test_n_choices_each_call(servers):
    server, _ = servers["qwen2.5"]
    out = chat(server, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0,
               seed=3, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert_valid_calls(choice.message)


BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": 3}}}]},
     "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "unknown"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "missing"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}, "tool_choice": "required"}, "combined"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}},
        "required": ["ids"]}}}], "tool_choice": "required"},
     "allow_approximate_schema"),
    ({"tools": TOOLS, "tool_choice": ["required"]}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}], "tools": TOOLS}, "only assistant"),
    ({"tools": TOOLS, "tool_choice": "required", "bootstrap_host": "127.0.0.1", "bootstrap_port": 9,
      "bootstrap_room": 1}, "disaggregation"),
]


@pytest.mark.parametrize(("extra", "match"), BAD)
def test_bad_tool_requests_are_400(servers, extra, match):
    server, _ = servers["qwen2.5"]
    response = requests.post(f"{server.url}/v1/chat/completions",
                             json={"messages": MESSAGES, "max_tokens": 40, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    assert match in response.json()["error"]["message"]
    if "tool_choice" in extra and "tools" in extra:  # streamed, the refusal still comes before the stream opens
        streamed = requests.post(f"{server.url}/v1/chat/completions", timeout=60,
                                 json={"messages": MESSAGES, "max_tokens": 40, "stream": True, **extra})
        assert streamed.status_code == 400 and match in streamed.json()["error"]["message"]


def test_hostile_history_and_schemas(servers):
    server, _ = servers["qwen2.5"]
    url = f"{server.url}/v1/chat/completions"

    def post(body: str) -> requests.Response:
        return requests.post(url, data=body.encode(), headers={"Content-Type": "application/json"}, timeout=60)

    no_id = [*MESSAGES, {"role": "tool", "content": "x"}]
    assert "tool_call_id" in requests.post(url, json={"messages": no_id, "tools": TOOLS}, timeout=60).text
    bad_args = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]
    assert requests.post(url, json={"messages": bad_args, "tools": TOOLS}, timeout=60).status_code == 400
    nan = '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": ' \
          '{"name": "f", "parameters": {"type": "object", "properties": {"a": {"maximum": NaN}}}}}]}'
    assert post(nan).status_code == 400
    surrogate = '{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "max_tokens": 4, ' \
                '"tools": [{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]}'
    assert post(surrogate).status_code == 400
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
    huge = requests.post(url, json={"messages": MESSAGES, "max_tokens": 4, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "wide", "parameters": wide}}]}, timeout=120)
    assert huge.status_code in (200, 400)
    assert chat(server, messages=MESSAGES, max_tokens=2).choices[0].message.content is not None  # still serving


def test_langchain_two_step_tool_loop(servers):
    """LangChain's ChatOpenAI: the model calls the tool, the tool's result goes back, the model answers."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone (UTC or CET)."""
        return {"UTC": "12:00", "CET": "13:00"}.get(zone, "unknown zone")

    server, _ = servers["qwen2.5"]
    with client_of(server) as client:
        model = client.models.list().data[0].id
    llm = ChatOpenAI(model=model, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=40,
                     max_retries=0)
    history = [HumanMessage("What time is it in UTC?")]
    call = llm.bind_tools([get_time], tool_choice="required").invoke(history)
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_time"
    history += [call, ToolMessage(get_time.invoke(call.tool_calls[0]["args"]), tool_call_id=call.tool_calls[0]["id"])]
    answer = llm.bind_tools([get_time]).invoke(history)
    assert not answer.tool_calls and answer.content


@pytest.fixture(scope="module")
def default_server(default_engine):
    server = AppOnThread(default_engine)
    yield server
    assert_server_pool_free(server.url)
    server.stop()


def test_default_model_required(default_server):
    """The default model's template knows no tools: they reach it in a system message, and required calls are
    constrained into the JSON array form; auto needs a format and says which flag picks one."""
    out = chat(default_server, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60,
               temperature=0, parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls"
    assert_valid_calls(out.message)
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        chat(default_server, messages=MESSAGES, tools=TOOLS, max_tokens=4)
