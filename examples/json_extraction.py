"""Structured extraction: constrain a gen with a pydantic model's JSON schema and read back a validated instance.

With `json_schema=Person` every token the model may sample keeps the output valid JSON for that schema, so even
a 135M-parameter model returns parseable, well-typed output; `state.get("person")` parses it into a Person.

Run: python examples/json_extraction.py
"""

from __future__ import annotations

from pydantic import BaseModel

import furcate as sgl


class Person(BaseModel):
    name: str
    age: int
    city: str


@sgl.function
def extract_person(s, sentence):
    s += sgl.system("Extract the person described in the text as JSON.")
    s += sgl.user(sentence)
    s += sgl.assistant(sgl.gen("person", json_schema=Person, max_tokens=64, temperature=0))


def main() -> None:
    with sgl.Engine("default", max_total_tokens=8192) as engine:
        sgl.set_default_backend(engine)
        sentences = ["Maria is a 34-year-old architect who lives in Lisbon.",
                     "Born 27 years ago, Kenji now works as a chef in Osaka."]
        states = extract_person.run_batch([{"sentence": s} for s in sentences])
        for sentence, state in zip(sentences, states):
            print(f"== {sentence} ==")
            print("raw text:     ", state["person"])
            person = state.get("person")  # parsed and validated by pydantic
            print("state.get():  ", repr(person))
            print(f"typed fields:  name={person.name!r}, age={person.age} ({type(person.age).__name__}), "
                  f"city={person.city!r}\n")


if __name__ == "__main__":
    main()
