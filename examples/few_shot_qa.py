"""Few-shot question answering: a fixed prompt of worked examples, then one gen per question, run as a batch.

The few-shot prefix is the same for every question, so run_batch sends it to the prefix cache once and every
program in the batch reuses its KV cache.

Run: python examples/few_shot_qa.py
"""

from __future__ import annotations

import time

import furcate as sgl

EXAMPLES = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome")]


@sgl.function
def few_shot_qa(s, country):
    for known, capital in EXAMPLES:
        s += f"The capital of {known} is {capital}.\n"
    s += f"The capital of {country} is"
    s += sgl.gen("answer", max_tokens=5, stop="\n", temperature=0)


def main() -> None:
    with sgl.Engine("default", max_total_tokens=8192) as engine:
        sgl.set_default_backend(engine)

        print("== one question ==")
        state = few_shot_qa.run(country="Spain")
        print(state.text())

        print("\n== a batch of questions ==")
        countries = ["Japan", "the United Kingdom", "China"]
        started = time.perf_counter()
        states = few_shot_qa.run_batch([{"country": c} for c in countries], progress_bar=True)
        for country, state in zip(countries, states):
            print(f"{country:>20} -> {state['answer'].strip().rstrip('.')}")
        print(f"batch took {time.perf_counter() - started:.1f}s, "
              f"prompt tokens served from the cache: {engine.get_stats()['cached_tokens_total']}")


if __name__ == "__main__":
    main()
