"""Fork and join: branch a program into parallel copies that share the text written so far.

`s.fork(n)` caches the shared prefix once, so every branch's request finds it in the KV cache ("cached_tokens"
in its meta info). `join()` gathers each variable the branches made into a list on the parent;
`join("concate_and_append")` appends the branches' text to the parent instead.

Run: python examples/parallel_branches.py
"""

from __future__ import annotations

import textwrap

import furcate as sgl

ASPECTS = ["food", "weather", "history"]


@sgl.function
def city_facts(s, city):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    forks = s.fork(len(ASPECTS))  # three copies of the state, each continuing after the system prompt
    forks += lambda i: sgl.user(f"Tell me one fact about the {ASPECTS[i]} of {city}.")
    forks += sgl.assistant(sgl.gen("fact", max_tokens=16, stop="\n"))
    s["cached"] = [f.get_meta_info("fact")["cached_tokens"] for f in forks]  # read before join
    s["prompt"] = [f.get_meta_info("fact")["prompt_tokens"] for f in forks]
    forks.join()  # the parent now has fact = [fact of branch 0, 1, 2]


@sgl.function
def two_tips(s, topic):
    s += f"Two tips about {topic}:\n"
    forks = s.fork(2)
    forks += lambda i: f"Tip {i + 1}:"
    forks += sgl.gen("tip", max_tokens=16, stop="\n")
    forks += "\n"
    forks.join("concate_and_append")  # the parent's text continues with each branch's text in turn
    s += "That's all."


def main() -> None:
    with sgl.Engine("default", max_total_tokens=8192) as engine:
        sgl.set_default_backend(engine)

        print("== fork(3) + join(): variables gathered into lists ==")
        state = city_facts.run(city="Paris", temperature=0)
        for aspect, fact, cached, prompt in zip(ASPECTS, state["fact"], state["cached"], state["prompt"]):
            fact = fact.strip() if fact.strip().endswith(".") else fact.strip() + " ..."  # cut at max_tokens
            print(textwrap.fill(f"{aspect:>8}: {fact}", width=100, subsequent_indent=" " * 10))
            print(f"{'':>8}  ({cached} of {prompt} prompt tokens came from the shared-prefix cache)")

        print("\n== fork(2) + join('concate_and_append'): branch text appended to the parent ==")
        state = two_tips.run(topic="learning to cook", temperature=0)
        print(state.text())

        print(f"\nprompt tokens served from the cache in all: {engine.get_stats()['cached_tokens_total']}")


if __name__ == "__main__":
    main()
