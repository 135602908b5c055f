"""The OpenAI API, driven by the official `openai` client unchanged, against a live server (tiny llama model)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from conftest import assert_server_pool_free

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture
def client(tiny_server):
    with openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
    assert_server_pool_free(tiny_server.url)


@pytest.fixture
def model(tiny_server) -> str:
    return requests.get(f"{tiny_server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def native(tiny_server, **body) -> dict:
    return requests.post(f"{tiny_server.url}/generate", json=body, timeout=120).json()


def test_models(client, tiny_model_dirs):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_model_dirs["llama"])]


def test_completion_equals_native_generate(client, model, tiny_server):
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0)
    reference = native(tiny_server, text="Once upon a time", sampling_params={"max_new_tokens": 10, "temperature": 0})
    assert out.choices[0].text == reference["text"]
    assert out.choices[0].finish_reason == reference["meta_info"]["finish_reason"]["type"]
    assert out.usage.completion_tokens == reference["meta_info"]["completion_tokens"]
    assert out.usage.prompt_tokens == reference["meta_info"]["prompt_tokens"]
    batch = client.completions.create(model=model, prompt=["Once upon a time", "Hello"], max_tokens=10, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == reference["text"]


def test_chat_uses_the_models_template(client, model, tiny_server, tokenizer):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    reference = native(tiny_server, input_ids=tokenizer.encode(prompt, add_special_tokens=False),
                       sampling_params={"max_new_tokens": 12, "temperature": 0})
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == reference["text"]
    assert out.usage.prompt_tokens == reference["meta_info"]["prompt_tokens"]
    limited = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=3,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert limited.choices[0].finish_reason == "length" and limited.usage.completion_tokens == 3


def test_chat_stream_with_usage(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_stream_with_n(client, model):
    chunks = list(client.completions.create(model=model, prompt="Pick", max_tokens=6, temperature=1.0, n=3, seed=7,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = {0: "", 1: "", 2: ""}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert chunks[-1].usage.completion_tokens == 18
    again = client.completions.create(model=model, prompt="Pick", max_tokens=6, temperature=1.0, n=3, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [texts[0], texts[1], texts[2]]  # the seed makes both runs agree


def test_seed_and_n(client, model):
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, n=3, seed=11)
    second = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, n=3, seed=11)
    assert len(first.choices) == 3
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == out.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())


def test_completion_logprobs_and_echo(client, model):
    out = client.completions.create(model=model, prompt="Say it", max_tokens=4, temperature=0, logprobs=2,
                                    echo=True, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith("Say it")
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text and logprobs.token_logprobs[0] is None
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])


def test_stop(client, model):
    free = client.completions.create(model=model, prompt="Go", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    cut = free[3:5]
    stopped = client.completions.create(model=model, prompt="Go", max_tokens=16, temperature=0, stop=[cut],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[: free.index(cut)]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["ok", "level"], "additionalProperties": False}


def test_response_format_json_schema(client, model):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    any_object = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60, temperature=0,
                                                response_format={"type": "json_object"})
    if any_object.choices[0].finish_reason == "stop":  # a random model may not close its object in 60 tokens
        assert isinstance(json.loads(any_object.choices[0].message.content), dict)
    else:
        assert any_object.choices[0].message.content.lstrip().startswith("{")


def test_schema_no_backend_enforces_exactly(client, model):
    """uniqueItems: refused with a 400 naming the keyword, unless the request allows an approximation."""
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    response_format = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": unique}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems.*allow_approximate_schema"):
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, temperature=0,
                                       response_format=response_format)
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, temperature=0,
                                         response_format=response_format,
                                         extra_body={"allow_approximate_schema": True})
    assert out.choices[0].message.content.startswith("[")


def test_errors_through_the_client(client, model):
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=model, prompt="x", max_tokens=2, logprobs=99)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "no-such-type"}}})
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):  # its template shows no call format
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, tools=[{
            "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
