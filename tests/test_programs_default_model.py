"""Programs on the real default model (SmolLM2-135M-Instruct): answers a person would check."""

from __future__ import annotations

from pydantic import BaseModel

import furcate as sgl
from conftest import assert_pool_free

FEW_SHOT = ("The capital of France is Paris.\nThe capital of Germany is Berlin.\n"
            "The capital of Italy is Rome.\n")


@sgl.function
def capital(s, country):
    s += FEW_SHOT + "The capital of " + country + " is" + sgl.gen("answer", max_tokens=5, stop="\n")


def test_few_shot_qa_answers_tokyo_london_beijing(default_engine):
    countries = ["Japan", "the United Kingdom", "China"]
    states = capital.run_batch([{"country": c} for c in countries], temperature=0, backend=default_engine)
    answers = [state["answer"] for state in states]
    for answer, city in zip(answers, ["Tokyo", "London", "Beijing"]):
        assert city in answer, answers
    assert_pool_free(default_engine)


def test_multi_turn_chat_is_the_models_own_template(default_engine, tokenizer):
    @sgl.function
    def chat(s):
        s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("first", max_tokens=24))
        s += sgl.user("And the capital of Japan?")
        s += sgl.assistant(sgl.gen("second", max_tokens=24))

    state = chat.run(temperature=0, backend=default_engine)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "Paris" in state["first"]
    assert "Tokyo" in state["second"]
    assert state.text() == tokenizer.apply_chat_template(messages, tokenize=False)


def test_select_classifies_and_gen_int_parses(default_engine):
    @sgl.function
    def quiz(s):
        s += sgl.user("Is the sun hot or cold? Answer with one word.")
        s += sgl.assistant(sgl.select("temp", choices=["hot", "cold"]))
        s += sgl.user("Which year did the Berlin wall fall?")
        s += sgl.assistant("It fell in " + sgl.gen_int("year", max_tokens=6))

    state = quiz.run(temperature=0, backend=default_engine)
    assert state["temp"] == "hot"
    assert state.get("year") == 1989


class City(BaseModel):
    name: str
    country: str


def test_json_extraction_into_a_pydantic_model(default_engine):
    @sgl.function
    def extract(s, sentence):
        s += sgl.user(f"Extract the city and its country as JSON from: {sentence}")
        s += sgl.assistant(sgl.gen("city", json_schema=City, max_tokens=48))

    state = extract.run("I flew to Tokyo, Japan last spring.", temperature=0, backend=default_engine)
    city = state.get("city")
    assert isinstance(city, City)
    assert "Tokyo" in city.name and "Japan" in city.country
