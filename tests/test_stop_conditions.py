"""Stop strings, stop ids, EOS, min/max tokens: each ends a request exactly where the spec says."""

from __future__ import annotations

import re

import pytest

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "the quiet hills and the river of stone"


def reference(engine, max_new_tokens: int = 24) -> dict:
    return engine.generate(PROMPT, {**GREEDY, "max_new_tokens": max_new_tokens})


def test_max_new_tokens_gives_length_finish(engine):
    out = reference(engine, 7)
    assert len(out["output_ids"]) == 7
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert out["meta_info"]["completion_tokens"] == 7


def test_stop_token_id_ends_at_first_occurrence(engine):
    ids = reference(engine)["output_ids"]
    stop = ids[5]
    first = ids.index(stop)
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 24, "stop_token_ids": [stop]})
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_min_new_tokens_masks_stop_ids(engine):
    ids = reference(engine)["output_ids"]
    stop = ids[1]
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 24, "stop_token_ids": [stop], "min_new_tokens": 6})
    assert len(out["output_ids"]) >= 6
    assert stop not in out["output_ids"][:6]


def test_eos_stops_unless_ignored(engine):
    force_eos = {"logit_bias": {2: 1000.0}, "temperature": 0.0, "max_new_tokens": 9}
    stopped = engine.generate(PROMPT, force_eos)
    assert stopped["output_ids"] == [2]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert stopped["text"] == ""
    ignored = engine.generate(PROMPT, {**force_eos, "ignore_eos": True})
    assert ignored["output_ids"] == [2] * 9
    assert ignored["meta_info"]["finish_reason"]["type"] == "length"
    delayed = engine.generate(PROMPT, {**force_eos, "min_new_tokens": 4})
    assert len(delayed["output_ids"]) == 5 and delayed["output_ids"][-1] == 2 and 2 not in delayed["output_ids"][:4]


def test_stop_string_is_trimmed_unless_no_stop_trim(engine, tokenizer):
    full = reference(engine)
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    cut = text.index(stop)
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 24, "stop": stop})
    assert out["text"] == text[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop in tokenizer.decode(out["output_ids"])
    kept = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 24, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].startswith(text[:cut] + stop)
    assert kept["output_ids"] == out["output_ids"]


def test_max_new_tokens_zero_only_prefills(engine):
    out = engine.generate(PROMPT, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]


def test_stop_regex_ends_at_the_first_match_and_trims_it(engine, tokenizer):
    full = reference(engine)
    text = full["text"]
    target = text[6:10]  # a regex that matches these four characters of the output (one class per character)
    pattern = "".join(f"[{re.escape(ch)}]" for ch in target)
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 24, "stop_regex": pattern})
    matched = out["meta_info"]["finish_reason"]
    assert matched["type"] == "stop" and matched["matched"] == target
    assert out["text"] == text[: text.index(target)]
    assert full["output_ids"][: len(out["output_ids"])] == out["output_ids"]


def test_stop_regex_that_does_not_compile_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="stop_regex"):
        engine.generate(PROMPT, {"stop_regex": "([a-"})
    with pytest.raises(ValueError, match="stop_regex"):
        engine.generate(PROMPT, {"stop_regex": 5})
