"""Reasoning models: a tiny Qwen3 model with the real Qwen3 chat template served live (reasoning_content apart from
content, streamed and not, a JSON schema and tool calls after the think block, enable_thinking off), the two
parsers on known texts, and `separate_reasoning` in programs."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

import furcate as sgl
from app_thread import AppOnThread
from conftest import TINY_POOL_TOKENS, assert_server_pool_free
from furcate import Engine
from furcate.runtime.tools.reasoning import FORMATS, ReasoningStream, detect, split
from tiny_models import TEMPLATES, build_tiny_chat_model

SCHEMA = {"type": "object", "properties": {"sunny": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["sunny", "level"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Is it sunny?"}]
THINK = {"max_reasoning_tokens": 6}  # the random model never closes its block itself: the server does


@pytest.fixture(scope="module")
def client(tmp_path_factory, default_model_dir):
    model_dir = build_tiny_chat_model("qwen3", tmp_path_factory.mktemp("qwen3") / "qwen3", default_model_dir)
    with Engine(str(model_dir), max_total_tokens=TINY_POOL_TOKENS, torch_num_threads=2, dtype="float32") as engine:
        server = AppOnThread(engine)
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client
        assert_server_pool_free(server.url)
        server.stop()


def create(client, **kwargs):
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, temperature=0,
                                         **kwargs)
    return list(out) if kwargs.get("stream") else out


def test_schema_after_the_think_block(client):
    out = create(client, max_tokens=60, response_format=RESPONSE_FORMAT, extra_body=THINK)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert out.usage.completion_tokens >= THINK["max_reasoning_tokens"]
    chunks = create(client, max_tokens=60, response_format=RESPONSE_FORMAT, extra_body=THINK, stream=True)
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content" for d in deltas if
             getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # all reasoning first, then the answer


def test_tool_call_after_the_think_block(client):
    tools = [{"type": "function", "function": {"name": "report", "parameters": SCHEMA}}]
    out = create(client, max_tokens=80, tools=tools, tool_choice="required", extra_body=THINK)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.reasoning_content
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMA)


def test_thinking_off_and_separation_off(client):
    off = create(client, max_tokens=40, response_format=RESPONSE_FORMAT,
                 extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.reasoning_content is None
    jsonschema.validate(json.loads(off.content), SCHEMA)
    # Without a block the model opened, a Qwen3 answer is all content; with separation off it is the same text.
    free = create(client, max_tokens=8).choices[0].message
    plain = create(client, max_tokens=8, extra_body={"separate_reasoning": False}).choices[0].message
    assert free.reasoning_content is None and free.content == plain.content
    scored = create(client, max_tokens=8, logprobs=True, extra_body={"ignore_eos": True}).choices[0]
    assert "".join(t.token for t in scored.logprobs.content) == scored.message.content == free.content


def test_abort_by_rid_ends_the_answer(client):
    """A request's rid names its parts: /abort_request with it aborts the part running, and the answer ends."""
    base = str(client.base_url).removesuffix("/v1/")
    with client.chat.completions.with_streaming_response.create(
            model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=900, temperature=0, stream=True,
            response_format=RESPONSE_FORMAT, extra_body={"rid": "thinking-abort", "ignore_eos": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the think block is streaming
        assert requests.post(f"{base}/abort_request", json={"rid": "thinking-abort"}, timeout=30).ok
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    streamed = sum(1 for e in events if e["choices"][0]["delta"].get("reasoning_content"))
    assert streamed < 900 and not any(e["choices"][0]["delta"].get("content") for e in events)


def test_parsers_on_known_texts():
    r1, qwen3 = FORMATS["deepseek-r1"], FORMATS["qwen3"]
    assert split(r1, "plan\n</think>\n\nanswer", True) == ("plan\n", "answer")
    assert split(r1, "all thought", r1.in_reasoning(None)) == ("all thought", "")
    assert split(qwen3, "<think>a</think>b", qwen3.in_reasoning(None)) == ("a", "b")
    assert split(qwen3, "no block", qwen3.in_reasoning(None)) == (None, "no block")
    assert split(qwen3, "text", False) == (None, "text")
    assert qwen3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert r1.opened_by("<｜Assistant｜><think>\n") is True
    assert qwen3.opened_by("<|im_start|>assistant\n") is None
    assert detect((TEMPLATES / "qwen3.jinja").read_text()) == "qwen3"
    assert detect((TEMPLATES / "qwen2.5.jinja").read_text()) is None


@pytest.mark.parametrize("text", ["<think>step one</think>\n\n{\"a\": 1}", "<thi", "plain answer", "<think>open",
                                  "<think>x</thi", "<think></think>"])
def test_streamed_split_equals_the_whole(text):
    """Fed every prefix, the stream sends exactly the final split, and nothing it must take back."""
    for name, begins in (("qwen3", None), ("deepseek-r1", True)):
        fmt = FORMATS[name]
        stream = ReasoningStream(fmt, begins)
        parts = [stream.feed(text[:end]) for end in range(1, len(text) + 1)] + [stream.feed(text, final=True)]
        reasoning, content = split(fmt, text, begins)
        assert "".join(r for r, _ in parts) == (reasoning or "")
        assert "".join(c for _, c in parts) == content


def test_separate_reasoning_in_a_program(engine):
    @sgl.function
    def think(s):
        s += "Question: 2 + 2?\n<think>\n"
        s += sgl.separate_reasoning(sgl.gen("answer", max_tokens=6, temperature=0), model_type="deepseek-r1")

    state = think.run(backend=sgl.LocalBackend(engine))
    assert state["answer"] == "" and state["answer_reasoning_content"]  # no </think> in 6 random tokens
    assert state["answer_reasoning_content"] in state.text()
    with pytest.raises(ValueError, match="named gen"):
        sgl.separate_reasoning(sgl.select("x", choices=["a"]), model_type="qwen3")

    @sgl.function
    def unknown(s):
        s += sgl.separate_reasoning(sgl.gen("a", max_tokens=1), model_type="nope")

    with pytest.raises(Exception, match="unknown reasoning parser"):
        unknown.run(backend=sgl.LocalBackend(engine)).sync()
