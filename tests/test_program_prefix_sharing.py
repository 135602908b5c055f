"""The prefix a program's branches (or a batch of programs) share is computed once, shown by cached_tokens."""

from __future__ import annotations

import pytest

import furcate as sgl

PREFIX = " ".join(f"clause {i} of the shared preamble;" for i in range(70))


@pytest.fixture
def fresh(engine, tokenizer):
    """The tiny engine with an empty cache; yields a function giving the prompt tokens computed so far."""
    assert engine.flush_cache()
    start = engine.get_stats()

    def computed() -> int:
        stats = engine.get_stats()
        return ((stats["prompt_tokens_total"] - start["prompt_tokens_total"])
                - (stats["cached_tokens_total"] - start["cached_tokens_total"]))

    prefix_tokens = len(tokenizer.encode(PREFIX))
    assert 450 <= prefix_tokens <= 700
    yield computed, prefix_tokens


def test_fork_computes_the_shared_prefix_once(engine, fresh):
    computed, prefix_tokens = fresh

    @sgl.function
    def tree(s):
        s += PREFIX
        forks = s.fork(8)
        forks += lambda i: f" path {i}:" + sgl.gen("step", max_tokens=2, temperature=0, ignore_eos=True)
        cached = [child.get_meta_info("step")["cached_tokens"] for child in forks]
        forks.join()
        return cached

    state = tree.run(backend=engine)
    assert len(state["step"]) == 8
    assert all(cached >= prefix_tokens - 2 for cached in state.ret_value), state.ret_value
    # Once for the commit, then a few tokens per child (without the commit: 8 x the prefix).
    assert computed() < prefix_tokens + 8 * 12


def test_run_batch_precaches_the_traced_preamble(engine, fresh):
    computed, prefix_tokens = fresh

    @sgl.function
    def classify(s, item):
        s += PREFIX
        s += f" item {item}:" + sgl.gen("label", max_tokens=2, temperature=0, ignore_eos=True)

    states = classify.run_batch([{"item": i} for i in range(32)], backend=engine)
    cached = [state.get_meta_info("label")["cached_tokens"] for state in states]
    assert all(c >= prefix_tokens - 2 for c in cached), cached
    assert computed() < prefix_tokens + 32 * 12


def test_select_shares_the_prefix_across_choices(engine, fresh):
    computed, prefix_tokens = fresh

    @sgl.function
    def pick(s):
        s += PREFIX + " answer:"
        s += sgl.select("c", choices=["alpha", "beta", "gamma", "delta"])

    pick.run(backend=engine)
    first = computed()
    assert first < 2 * prefix_tokens  # the choices, sent together, computed the prefix once between them
    pick.run(backend=engine)  # the second run finds the prefix cached
    assert computed() - first < 4 * 6
