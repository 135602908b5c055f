"""Programs on the tiny llama engine: every construct, against the engine's own output and HF's logprobs."""

from __future__ import annotations

import asyncio
import re

import pytest
from pydantic import BaseModel, ConfigDict, Field

import furcate as sgl
from conftest import EXACT, NO_GRAMMAR
from furcate import ProgramError

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = "the river of stone and the quiet hills"


@pytest.fixture
def backend(engine):
    sgl.set_default_backend(engine)
    yield engine
    sgl.set_default_backend(None)


@sgl.function
def one_gen(s, prompt, max_tokens=8):
    s += prompt
    s += sgl.gen("out", max_tokens=max_tokens, **GREEDY)


def test_gen_appends_what_the_engine_generates(backend):
    state = one_gen.run(PROMPT)
    expected = backend.generate(PROMPT, {"max_new_tokens": 8, **GREEDY})
    assert state["out"] == expected["text"]
    assert state.text() == PROMPT + expected["text"]
    assert state.get_meta_info("out")["completion_tokens"] == 8


def test_run_defaults_are_inherited_and_gen_overrides_them(backend):
    @sgl.function
    def two(s):
        s += PROMPT + sgl.gen("a") + sgl.gen("b", max_tokens=3)

    state = two.run(max_new_tokens=5, temperature=0, ignore_eos=True)
    assert state.get_meta_info("a")["completion_tokens"] == 5
    assert state.get_meta_info("b")["completion_tokens"] == 3


def _hand_scores(tokenizer, reference, prompt, choices):
    """Per choice: HF logprobs of its tokens after the prompt, and after the start token alone."""
    prompt_ids = tokenizer.encode(prompt)
    rows = []
    for choice in choices:
        ids = tokenizer.encode(prompt + choice)
        start = next(i for i, (a, b) in enumerate(zip(prompt_ids + [None], ids)) if a != b)
        full = reference.logprobs(ids)
        conditional = [full[p - 1, ids[p]].item() for p in range(start, len(ids))]
        bare = [tokenizer.bos_token_id] + ids[start:]
        alone = reference.logprobs(bare)
        unconditional = [alone[p - 1, bare[p]].item() for p in range(1, len(bare))]
        rows.append((conditional, unconditional))
    return rows


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_select_scores_match_a_hand_computation_from_hf_logprobs(backend, hf_reference, tokenizer, method):
    choices = ["blue sky", "red", "green river of light", " stone"]

    @sgl.function
    def pick(s):
        s += PROMPT + sgl.select("c", choices=choices, choices_method=method)

    state = pick.run()
    rows = _hand_scores(tokenizer, hf_reference("llama"), PROMPT, choices)
    meta = state.get_meta_info("c")
    for got, (conditional, _) in zip(meta["choice_token_logprobs"], rows):
        assert got == pytest.approx(conditional, abs=1e-4)
    expected = method(choices, [sgl.lang.ChoiceScores(c, u) for c, u in rows]).decision
    assert state["c"] == expected and state["c"] in choices
    assert state.text() == PROMPT + expected
    if method is sgl.unconditional_likelihood_normalized:
        for got, (_, unconditional) in zip(meta["unconditional_token_logprobs"], rows):
            assert got == pytest.approx(unconditional, abs=1e-4)


def test_regex_and_dtype_gens_match_and_parse(backend):
    @sgl.function
    def typed(s):
        s += PROMPT + " code: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", temperature=0)
        s += " n=" + sgl.gen_int("n", max_tokens=6, temperature=0)
        s += " ok=" + sgl.gen("ok", dtype=bool, temperature=0)
        s += " f=" + sgl.gen("f", dtype=float, max_tokens=8, temperature=0)

    state = typed.run()
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", state["code"])
    for name, kind in (("n", int), ("ok", bool)):
        assert isinstance(state.get(name), kind)
    assert state.get("ok") == (state["ok"] == "True")
    if state.get_meta_info("f")["finish_reason"]["type"] == "stop":  # a float may run to max_tokens in digits
        assert isinstance(state.get("f"), float)
    assert state.get("n") == int(state["n"]) and state.get("n", float) == float(state["n"])


class Pet(BaseModel):
    # Closed and bounded, so even a random model's output ends within its tokens (JSON Schema allows unlisted
    # properties unless told otherwise, and the grammar follows it).
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)


def test_json_schema_gen_gives_a_validated_model_instance(backend):
    @sgl.function
    def extract(s):
        s += PROMPT + " as JSON: " + sgl.gen("pet", json_schema=Pet, max_tokens=200, temperature=0)

    state = extract.run()
    assert state.get_meta_info("pet")["finish_reason"]["type"] == "stop"
    pet = state.get("pet")
    assert isinstance(pet, Pet)
    assert state.get("pet", {"type": "object"})["legs"] == pet.legs  # a schema dict parses into plain JSON


def test_n_samples_give_a_list_and_the_text_continues_with_the_first(backend):
    @sgl.function
    def many(s):
        s += PROMPT + sgl.gen("x", n=3, max_tokens=4, temperature=1.0, ignore_eos=True)

    state = many.run()
    assert isinstance(state["x"], list) and len(state["x"]) == 3
    assert state.text() == PROMPT + state["x"][0]


def test_fork_gathers_variables_and_concat_appends_text(backend):
    @sgl.function
    def branches(s):
        s += PROMPT
        forks = s.fork(3)
        forks += lambda i: f" branch {i}:" + sgl.gen("idea", max_tokens=4, **GREEDY)
        forks.join()
        more = s.fork(2)
        more += [" left", " right"]
        more.join("concate_and_append")

    state = branches.run()
    ideas = state["idea"]
    assert len(ideas) == 3
    for i, idea in enumerate(ideas):
        assert idea == backend.generate(f"{PROMPT} branch {i}:", {"max_new_tokens": 4, **GREEDY})["text"]
    assert state.text() == PROMPT + " left right"


def test_nested_forks_give_nested_lists(backend):
    @sgl.function
    def tree(s):
        s += PROMPT
        outer = s.fork(2)
        for i, child in enumerate(outer):
            child += f" {i}"
            inner = child.fork(2)
            inner += lambda j: sgl.gen("leaf", max_tokens=2, **GREEDY)
            inner.join()
        outer.join()

    leaves = tree.run()["leaf"]
    assert len(leaves) == 2 and all(isinstance(pair, list) and len(pair) == 2 for pair in leaves)


def test_copy_var_scope_set_and_contains(backend):
    @sgl.function
    def scoped(s):
        s += "head "
        with s.var_scope("body"):
            s += "inside" + sgl.gen("g", max_tokens=2, **GREEDY)
        s["flag"] = 7
        with s.copy() as c:
            c += " copied" + sgl.gen("in_copy", max_tokens=2, **GREEDY)
        return "done"

    state = scoped.run()
    assert state["body"] == "inside" + state["g"]
    assert state["flag"] == 7 and "flag" in state and "nothing" not in state
    assert state["in_copy"] == [backend.generate("head inside" + state["g"] + " copied",
                                                 {"max_new_tokens": 2, **GREEDY})["text"]]
    assert state.ret_value == "done"


def test_roles_render_with_the_models_own_chat_template(backend, tokenizer):
    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        with s.user():
            s += "Hello there"
        s += sgl.assistant(sgl.gen("reply", max_tokens=4, **GREEDY))
        s += sgl.user("And again?")

    state = chat.run()
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == state["reply"]
    assert state.text() == tokenizer.apply_chat_template(messages, tokenize=False)


def test_a_template_default_system_prompt_appears_in_messages(backend, tokenizer):
    @sgl.function
    def chat(s):
        s += sgl.user("Hi")

    state = chat.run()
    messages = state.messages()
    # SmolLM2's template inserts its own system prompt when a conversation does not start with one.
    assert messages[0]["role"] == "system" and "SmolLM" in messages[0]["content"]
    assert state.text() == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)


def test_run_batch_keeps_input_order_and_shows_progress(backend, capsys):
    prompts = [f"{PROMPT} {i}" for i in range(12)]
    states = one_gen.run_batch([{"prompt": p, "max_tokens": 2 + i % 3} for i, p in enumerate(prompts)],
                               progress_bar=True)
    for i, (state, prompt) in enumerate(zip(states, prompts)):
        assert state.text().startswith(prompt)
        assert state.get_meta_info("out")["completion_tokens"] == 2 + i % 3
    assert "12/12" in capsys.readouterr().err
    generated = list(one_gen.run_batch([(p,) for p in prompts[:3]], generator_style=True))
    assert [s.text()[: len(p)] for s, p in zip(generated, prompts)] == prompts[:3]


def test_streaming_equals_non_streaming(backend):
    @sgl.function
    def story(s):
        s += PROMPT + sgl.gen("a", max_tokens=12, **GREEDY) + " then" + sgl.gen("b", max_tokens=6, **GREEDY)

    plain = story.run()
    streamed = story.run(stream=True)
    chunks_a = list(streamed.text_iter("a"))
    assert len(chunks_a) > 1 and "".join(chunks_a) == plain["a"]
    assert "".join(streamed.text_iter()) == plain.text() == streamed.text()

    async def collect():
        state = await story.arun(stream=True)
        return [chunk async for chunk in state.text_async_iter("b", return_meta_data=True)]

    pairs = asyncio.run(collect())
    assert "".join(text for text, _ in pairs) == plain["b"]
    assert pairs[-1][1]["completion_tokens"] == 6


def test_async_programs_and_async_batches(backend):
    @sgl.function
    async def program(s, i):
        s += f"{PROMPT} {i}" + sgl.gen("x", max_tokens=3, **GREEDY)
        first = await s.aget("x")
        s += " again" + sgl.gen("y", max_tokens=2, **GREEDY)
        return first

    async def main():
        single = await program.arun(0)
        batch = await program.arun_batch([{"i": i} for i in range(4)])
        return single, batch

    single, batch = asyncio.run(main())
    assert single.ret_value == single["x"]
    assert [s.text().split(" again")[0] for s in batch] == [f"{PROMPT} {i}" + s["x"] for i, s in enumerate(batch)]
    assert program.run(1)["x"] == batch[1]["x"]  # run() of an async program outside a loop works too


def test_a_rejected_request_raises_at_the_read_naming_the_node(backend):
    @sgl.function
    def bad(s):
        s += PROMPT + sgl.gen("fine", max_tokens=2, **GREEDY)
        s += sgl.gen("broken", regex="([a-z", max_tokens=2)
        s += sgl.gen("after", max_tokens=2)

    with pytest.raises(ProgramError, match=r"gen\('broken'\) failed: ValueError") as caught:
        bad.run()
    assert isinstance(caught.value.cause, ValueError)

    state = bad.run(stream=True)
    with pytest.raises(ProgramError, match="broken"):
        state["after"]
    assert state["fine"]  # nodes before the failure keep their values
    assert "broken" in str(state.error())


def test_a_prompt_too_long_and_an_exception_in_the_program_surface_from_run(backend):
    with pytest.raises(ProgramError, match="gen.*limit"):
        one_gen.run("word " * 7000)

    @sgl.function
    def raises(s):
        s += PROMPT
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        raises.run()


def test_a_failing_program_in_a_batch_does_not_stop_the_others(backend):
    states = one_gen.run_batch([{"prompt": PROMPT}, {"prompt": "word " * 7000}, {"prompt": PROMPT}])
    assert states[0]["out"] == states[2]["out"]
    assert isinstance(states[1].error(), ProgramError)
    with pytest.raises(ProgramError):
        states[1]["out"]


def test_misuse_is_a_clear_error(backend):
    @sgl.function
    def program(s):
        s += PROMPT

    state = program.run()
    with pytest.raises(ValueError, match="None"):
        state += None
    with pytest.raises(KeyError, match="no variable 'missing'"):
        state["missing"]
    with pytest.raises(ValueError, match="fork size"):
        state.fork(0)
    with pytest.raises(ProgramError, match="image.*text-only"):
        program.bind().run  # noqa: B018 - attribute access only
        sgl.function(lambda s: s.__iadd__(sgl.image("cat.png"))).run()
    with pytest.raises(ProgramError, match="roles do not nest"):
        sgl.function(lambda s: s.__iadd__(sgl.user_begin() + sgl.user_begin())).run()
    with pytest.raises(TypeError, match="run_batch takes a list"):
        program.run_batch({"a": 1})


def test_a_backend_failure_surfaces_as_a_program_error(tiny_model_dirs):
    engine = sgl.Engine(str(tiny_model_dirs["llama"]), **EXACT, **NO_GRAMMAR, max_total_tokens=512,
                        torch_num_threads=1)
    engine.shutdown()
    with pytest.raises(ProgramError, match="shut down"):
        one_gen.run(PROMPT, backend=engine)


def test_no_backend_is_a_clear_error():
    sgl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="set_default_backend"):
        one_gen.run(PROMPT)


def test_a_chat_template_of_ones_own(engine):
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    backend = sgl.LocalBackend(engine, chat_template=template)

    @sgl.function
    def chat(s):
        s += sgl.user("hi") + sgl.assistant("hello")

    state = chat.run(backend=backend)
    assert state.text() == "[user]hi[/user]\n[assistant]hello[/assistant]\n"
    assert state.messages() == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert "".join(state.text_iter()) == state.text()  # after the run, the iterator replays the whole text
    with pytest.raises(ValueError, match="Jinja"):
        sgl.LocalBackend(engine, chat_template=5)


def test_cache_sends_the_traced_prefix(engine):
    @sgl.function
    def program(s, x):
        s += sgl.system("A long and constant system prompt for every call.") + "Question: " + x

    prefix = program.cache(engine)
    assert prefix.endswith("Question: ") and "constant system prompt" in prefix
    state = program.run("why?", backend=engine)
    assert state.text() == prefix + "why?"
