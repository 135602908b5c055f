"""The remote backends against a live furcate server on the tiny llama model: programs on RuntimeEndpoint (native
HTTP) and on OpenAI (furcate's own /v1 routes) give what the same programs give on the in-process engine."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

import furcate as sgl
from conftest import NO_GRAMMAR, assert_server_pool_free
from furcate import ProgramError
from furcate.interpreter.backends.base import choice_starts
from furcate.interpreter.backends.jinja_template import JinjaTemplateTokenizer
from furcate.interpreter.backends.openai_backend import chat_messages, escape_regex

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = "the river of stone and the quiet hills"
COMPARED_META = ("finish_reason", "prompt_tokens", "completion_tokens")
METHODS = [sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized]
CHOICES = ["blue sky", "red", "green river of light", " stone"]


@pytest.fixture(scope="module")
def endpoint(tiny_server):
    backend = sgl.RuntimeEndpoint(tiny_server.url)
    yield backend
    backend.close()
    assert_server_pool_free(tiny_server.url)  # whatever the programs sent, the server's KV pool is whole


@pytest.fixture(scope="module")
def openai_backends(tiny_server, tiny_model_dirs):
    """The same server through its OpenAI routes: plain OpenAI, and with furcate's extra sampling fields."""
    name = str(tiny_model_dirs["llama"])
    plain = sgl.OpenAI(name, base_url=tiny_server.url + "/v1")
    extended = sgl.OpenAI(name, base_url=tiny_server.url + "/v1", server_extensions=True)
    yield plain, extended
    plain.close()
    extended.close()
    assert_server_pool_free(tiny_server.url)


def on_both(program, local, remote, *args, **kwargs):
    """The program run on the in-process engine and on the remote backend."""
    return program.run(*args, backend=local, **kwargs), program.run(*args, backend=remote, **kwargs)


def assert_close(got, expected) -> None:
    """Equal structure, floats within 1e-4: the server's batches may differ from the local engine's."""
    if isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_close(g, e)
    else:
        assert got == pytest.approx(expected, abs=1e-4)


def assert_same_meta(local_meta: dict, remote_meta: dict) -> None:
    for key in COMPARED_META:
        assert remote_meta[key] == local_meta[key], key


# -- pure parts -----------------------------------------------------------------------------------------------


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}],
]
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                "{% endfor %}")


@pytest.mark.parametrize("template", [None, BOS_TEMPLATE])
def test_a_template_without_its_tokenizer_renders_as_the_tokenizer_does(tokenizer, template):
    special = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    standalone = JinjaTemplateTokenizer(tokenizer.chat_template, special)
    for messages in CONVERSATIONS:
        expected = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
        assert standalone.apply_chat_template(messages, tokenize=False, chat_template=template) == expected


def test_a_choice_starts_where_its_tokens_leave_the_prompts():
    prompt = [5, 6, 7]
    # Plain continuation; a merge of the prompt's last token with the choice (healed); a choice adding nothing.
    assert choice_starts(prompt, [[5, 6, 7, 8], [5, 6, 9, 10], [5, 6, 7]]) == [3, 2, 2]
    assert choice_starts(["a", " b"], [["a", " b", "c"], ["a", " bc"]]) == [2, 1]


def test_openai_chat_prompts_split_into_messages():
    backend = sgl.OpenAI("m", base_url="http://127.0.0.1:9/v1")
    markers = {role: backend.chat_template().markers(role) for role in ("system", "user", "assistant")}
    text = (markers["system"].first_prefix + "Be terse." + markers["system"].suffix
            + markers["user"].prefix + "line one\nline two" + markers["user"].suffix + markers["assistant"].prefix)
    assert chat_messages(text, "a gen") == [{"role": "system", "content": "Be terse."},
                                            {"role": "user", "content": "line one\nline two"}]
    with pytest.raises(ValueError, match="cannot continue the assistant message"):
        chat_messages(text + "It is", "a gen")
    with pytest.raises(ValueError, match="must open the assistant's turn"):
        chat_messages("preamble " + text, "a gen")
    assert escape_regex("a.b (c)|d e") == r"a\.b \(c\)\|d e"


# -- RuntimeEndpoint: the native protocol ----------------------------------------------------------------------


@sgl.function
def continuation(s, prompt, max_tokens=8):
    s += prompt + sgl.gen("out", max_tokens=max_tokens, **GREEDY)


def test_gen_equals_the_local_engine(llama_engine, endpoint):
    local, remote = on_both(continuation, llama_engine, endpoint, PROMPT)
    assert remote["out"] == local["out"] and remote.text() == local.text()
    assert_same_meta(local.get_meta_info("out"), remote.get_meta_info("out"))


def test_an_endpoint_is_its_own_endpoint_and_a_default_backend(endpoint):
    assert endpoint.endpoint is endpoint
    sgl.set_default_backend(endpoint)
    try:
        assert continuation.run(PROMPT, max_tokens=3).get_meta_info("out")["completion_tokens"] == 3
    finally:
        sgl.set_default_backend(None)


@pytest.mark.parametrize("method", METHODS)
def test_select_scores_and_decides_as_the_local_engine(llama_engine, endpoint, method):
    @sgl.function
    def pick(s):
        s += PROMPT + sgl.select("c", choices=CHOICES, choices_method=method)

    local, remote = on_both(pick, llama_engine, endpoint)
    assert remote["c"] == local["c"]
    local_meta, remote_meta = local.get_meta_info("c"), remote.get_meta_info("c")
    assert remote_meta.keys() == local_meta.keys()
    for key, value in local_meta.items():
        assert_close(remote_meta[key], value)


def test_fork_join_n_samples_and_run_batch_equal_the_local_engine(llama_engine, endpoint):
    @sgl.function
    def branches(s):
        s += PROMPT
        forks = s.fork(3)
        forks += lambda i: f" branch {i}:" + sgl.gen("idea", max_tokens=4, **GREEDY)
        forks.join()
        s += " then" + sgl.gen("many", n=2, max_tokens=3, **GREEDY)

    local, remote = on_both(branches, llama_engine, endpoint)
    assert remote["idea"] == local["idea"] and len(remote["idea"]) == 3
    assert remote["many"] == local["many"] and len(remote["many"]) == 2
    assert remote.text() == local.text()
    batch = [{"prompt": f"{PROMPT} {i}", "max_tokens": 2 + i % 3} for i in range(6)]
    outs = [[s["out"] for s in continuation.run_batch(batch, backend=b)] for b in (llama_engine, endpoint)]
    assert outs[0] == outs[1]


def test_a_forked_prefix_is_computed_once_on_the_server(endpoint, tokenizer):
    preamble = " ".join(f"clause {i} of the shared preamble;" for i in range(40))

    @sgl.function
    def tree(s):
        s += preamble
        forks = s.fork(4)
        forks += lambda i: f" path {i}:" + sgl.gen("step", max_tokens=2, **GREEDY)
        return [child.get_meta_info("step")["cached_tokens"] for child in forks]

    assert endpoint.flush_cache()
    cached = tree.run(backend=endpoint).ret_value
    assert all(c >= len(tokenizer.encode(preamble)) - 2 for c in cached), cached


def test_roles_render_with_the_servers_template(llama_engine, endpoint, tokenizer):
    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        s += sgl.user("Hello there")
        s += sgl.assistant(sgl.gen("reply", max_tokens=4, **GREEDY))
        s += sgl.user("And again?")

    @sgl.function
    def default_system(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("reply", max_tokens=3, **GREEDY))

    for program in (chat, default_system):
        local, remote = on_both(program, llama_engine, endpoint)
        assert remote.text() == local.text()
        assert remote.messages() == local.messages()
        assert remote.text().startswith(tokenizer.apply_chat_template(remote.messages()[:-1], tokenize=False))


class Pet(BaseModel):
    # Closed and bounded, so even a random model's output ends within its tokens.
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)


class Verdict(BaseModel):
    ok: bool


def test_constrained_gens_equal_the_local_engine(llama_engine, endpoint):
    @sgl.function
    def typed(s):
        s += PROMPT + " as JSON: " + sgl.gen("pet", json_schema=Pet, max_tokens=200, temperature=0)
        s += " code: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", temperature=0)
        s += " n=" + sgl.gen_int("n", max_tokens=6, temperature=0)

    local, remote = on_both(typed, llama_engine, endpoint)
    assert remote.text() == local.text()
    assert isinstance(remote.get("n"), int) and remote.get("n") == local.get("n")
    assert remote.get_meta_info("pet")["finish_reason"]["type"] == "stop"
    assert remote.get("pet") == local.get("pet") and isinstance(remote.get("pet"), Pet)


def test_streaming_equals_non_streaming_and_the_local_engine(llama_engine, endpoint):
    @sgl.function
    def story(s):
        s += PROMPT + sgl.gen("a", max_tokens=10, **GREEDY) + " then" + sgl.gen("b", max_tokens=5, **GREEDY)

    local = story.run(backend=llama_engine)
    streamed = story.run(backend=endpoint, stream=True)
    chunks = list(streamed.text_iter("a"))
    assert len(chunks) > 1 and "".join(chunks) == local["a"]
    assert "".join(streamed.text_iter()) == local.text() == streamed.text()
    assert streamed.get_meta_info("b")["completion_tokens"] == 5


def test_server_errors_surface_as_program_errors(endpoint):
    @sgl.function
    def bad(s):
        s += PROMPT + sgl.gen("broken", regex="([a-z", max_tokens=2)

    with pytest.raises(ProgramError, match=r"gen\('broken'\) failed: ValueError") as caught:
        bad.run(backend=endpoint)
    assert "HTTP 400" in str(caught.value.cause)
    state = bad.run(backend=endpoint, stream=True)
    with pytest.raises(ProgramError, match="broken"):
        state["broken"]
    with pytest.raises(ProgramError, match="gen.*limit"):
        continuation.run("word " * 2000, backend=endpoint)


def test_cache_and_server_info(endpoint, tiny_model_dirs):
    assert endpoint.flush_cache() is True
    info = sgl.get_server_info(endpoint)
    assert info["model_path"] == str(tiny_model_dirs["llama"])
    assert endpoint.model_info["chat_template"]


# -- Runtime: a server of its own -----------------------------------------------------------------------------


def test_runtime_starts_serves_and_shuts_down_with_its_key(tiny_model_dirs):
    runtime = sgl.Runtime(str(tiny_model_dirs["llama"]), api_key="sesame", max_total_tokens=2000,
                          torch_num_threads=1, dtype="float32", **NO_GRAMMAR)
    try:
        assert runtime.url.startswith("http://127.0.0.1:")
        assert runtime.endpoint.endpoint is runtime.endpoint
        state = continuation.run(PROMPT, max_tokens=3, backend=runtime)  # a Runtime passes as its endpoint
        assert state.get_meta_info("out")["completion_tokens"] == 3
        with pytest.raises(ValueError, match="API key.*HTTP 401"):
            sgl.RuntimeEndpoint(runtime.url)
    finally:
        runtime.shutdown()
    assert runtime.server.process.poll() is not None
    runtime.shutdown()  # a second shutdown does nothing
    with pytest.raises(ConnectionError, match="cannot reach"):
        sgl.RuntimeEndpoint(runtime.url)


# -- OpenAI: furcate's /v1 routes -----------------------------------------------------------------------------


def test_openai_completions_gen_equals_the_local_engine(llama_engine, openai_backends):
    plain, extended = openai_backends
    local = continuation.run(PROMPT, backend=llama_engine)
    remote = continuation.run(PROMPT, backend=extended)
    assert remote["out"] == local["out"]
    assert_same_meta(local.get_meta_info("out"), remote.get_meta_info("out"))
    with pytest.raises(ProgramError, match="ignore_eos is not part of the OpenAI API"):
        continuation.run(PROMPT, backend=plain)
    stream = continuation.run(PROMPT, backend=extended, stream=True)
    assert "".join(stream.text_iter("out")) == local["out"]
    assert stream.get_meta_info("out")["finish_reason"]["type"] == "length"


def test_openai_chat_roles_and_json_schema_equal_the_local_engine(llama_engine, openai_backends):
    plain, _ = openai_backends

    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        s += sgl.user("Hello there")
        s += sgl.assistant(sgl.gen("reply", max_tokens=6, temperature=0))
        s += sgl.user("Is that right? Answer as JSON.")
        s += sgl.assistant(sgl.gen("verdict", json_schema=Verdict, max_tokens=64, temperature=0))

    local, remote = on_both(chat, llama_engine, plain)
    assert remote["reply"] == local["reply"]
    assert remote["verdict"] == local["verdict"]
    assert isinstance(remote.get("verdict"), Verdict)
    streamed = chat.run(backend=plain, stream=True)
    assert "".join(streamed.text_iter()) == remote.text() == streamed.text()
    assert streamed.get_meta_info("reply")["finish_reason"] == remote.get_meta_info("reply")["finish_reason"]
    assert remote.messages() == local.messages()
    assert remote.text().startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")

    @sgl.function
    def continued(s):
        s += sgl.user("When?") + sgl.assistant("It was in " + sgl.gen("year", max_tokens=4))

    with pytest.raises(ProgramError, match="cannot continue the assistant message"):
        continued.run(backend=plain)


@pytest.mark.parametrize("method", METHODS[:2])
def test_openai_select_by_echoed_logprobs_equals_the_local_engine(llama_engine, openai_backends, method):
    plain, _ = openai_backends

    @sgl.function
    def pick(s):
        s += PROMPT + sgl.select("c", choices=CHOICES, choices_method=method)

    local, remote = on_both(pick, llama_engine, plain)
    assert remote["c"] == local["c"]
    assert_close(remote.get_meta_info("c")["choice_token_logprobs"], local.get_meta_info("c")["choice_token_logprobs"])


def test_openai_select_on_chat_prompts_is_constrained_and_regex_needs_extensions(openai_backends):
    plain, extended = openai_backends
    choices = ["hot", "cold", "warm water"]

    @sgl.function
    def quiz(s):
        s += sgl.user("Is the sun hot or cold?") + sgl.assistant(sgl.select("temp", choices=choices))

    for backend in (plain, extended):
        state = quiz.run(backend=backend)
        assert state["temp"] in choices
        assert state.messages()[-1] == {"role": "assistant", "content": state["temp"]}

    @sgl.function
    def uncond(s):
        s += PROMPT + sgl.select("c", choices=CHOICES, choices_method=sgl.unconditional_likelihood_normalized)

    with pytest.raises(ProgramError, match="unconditional_likelihood_normalized needs"):
        uncond.run(backend=plain)

    @sgl.function
    def code(s):
        s += PROMPT + " code: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", temperature=0)

    with pytest.raises(ProgramError, match="regex is not part of the OpenAI API"):
        code.run(backend=plain)
    assert len(code.run(backend=extended)["code"]) == 6
