"""GenerateRequest, the typed value one generate call becomes: SGLang's keywords checked and normalized as the call
is made (wrong types, a dict where a list belongs, NaN and sizes past a limit are ValueErrors naming the argument),
the bootstrap keywords collected into BootstrapFields, and the engine's generate taking both spellings."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from furcate.runtime.engine.generate_request import (
    MAX_REQUESTS_PER_CALL,
    BootstrapFields,
    GenerateRequest,
    bootstrap_of,
)

GOOD = {"max_new_tokens": 4, "temperature": 0}


def test_a_single_prompt_and_a_list_are_told_apart_and_normalized():
    one = GenerateRequest("hi", GOOD)
    assert (one.texts, one.token_ids, one.single) == (("hi",), None, True)
    many = GenerateRequest(["a", "b"], [GOOD, GOOD])
    assert (many.texts, many.single) == (("a", "b"), False)
    ids = GenerateRequest(input_ids=[5, 6])
    assert (ids.texts, ids.token_ids, ids.single) == (None, ((5, 6),), True)
    assert GenerateRequest(input_ids=[[5], (6, 7)]).token_ids == ((5,), (6, 7))


def test_defaults_are_sglangs():
    call = GenerateRequest("x")
    assert (call.sampling_params, call.return_logprob, call.logprob_start_len, call.top_logprobs_num) == \
        (None, False, -1, 0)
    assert (call.return_text_in_logprobs, call.stream, call.rid, call.timeout, call.image_data, call.bootstrap) == \
        (False, False, None, None, None, None)


def test_the_request_is_frozen_and_holds_its_own_copy_of_the_prompts():
    ids = [1, 2, 3]
    call = GenerateRequest(input_ids=ids)
    ids.append(4)  # the caller's list changing later changes nothing that was checked
    assert call.token_ids == ((1, 2, 3),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.stream = True


def test_numpy_integers_are_token_ids():
    np = pytest.importorskip("numpy")
    call = GenerateRequest(input_ids=list(np.array([5, 17])))
    assert call.token_ids == ((5, 17),) and all(type(t) is int for t in call.token_ids[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of prompt"),
        ({"prompt": "x", "input_ids": [1]}, "exactly one of prompt"),
        ({"prompt": 5}, "prompt must be a string or a non-empty list of strings, got int"),
        ({"prompt": {"text": "x"}}, "prompt must be .* got dict"),
        ({"prompt": ["ok", {"text": "x"}]}, "prompt must be"),
        ({"prompt": []}, "prompt must be"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": ["a", ""]}, "prompt 1 is empty"),
        ({"prompt": "\ud800"}, "not valid text"),
        ({"input_ids": {"ids": [1]}}, "input_ids must be a list .* got dict"),
        ({"input_ids": [{"id": 1}]}, "input_ids must be a non-empty list"),
        ({"input_ids": "1 2"}, "input_ids must be a list"),
        ({"input_ids": []}, "input_ids must be a non-empty list"),
        ({"input_ids": [[1], []]}, "input_ids must be a non-empty list"),
        ({"input_ids": [[1, 2.0]]}, r"input_ids must hold integer token ids, got \[2.0\]"),
        ({"input_ids": [[1, float("nan")]]}, "input_ids must hold integer token ids"),
        ({"input_ids": [True, False]}, "input_ids"),
        ({"prompt": ["x"] * (MAX_REQUESTS_PER_CALL + 1)}, f"at most {MAX_REQUESTS_PER_CALL} requests"),
        ({"input_ids": [[1]] * (MAX_REQUESTS_PER_CALL + 1)}, f"at most {MAX_REQUESTS_PER_CALL} requests"),
        ({"prompt": "x", "return_logprob": "yes"}, "return_logprob must be true or false"),
        ({"prompt": "x", "stream": 1}, "stream must be true or false"),
        ({"prompt": "x", "return_text_in_logprobs": None}, "return_text_in_logprobs"),
        ({"prompt": "x", "rid": ""}, "rid must be a non-empty string"),
        ({"prompt": "x", "rid": ["a"]}, "rid must be a non-empty string"),
        ({"prompt": "x", "top_logprobs_num": 2}, "top_logprobs_num needs return_logprob"),
        ({"prompt": "x", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num must be"),
        ({"prompt": "x", "return_logprob": True, "top_logprobs_num": 2.5}, "top_logprobs_num must be"),
        ({"prompt": "x", "return_logprob": True, "top_logprobs_num": float("nan")}, "top_logprobs_num must be"),
        ({"prompt": "x", "logprob_start_len": -2}, "logprob_start_len must be"),
        ({"prompt": "x", "logprob_start_len": float("nan")}, "logprob_start_len must be"),
        ({"prompt": "x", "logprob_start_len": True}, "logprob_start_len must be"),
        ({"prompt": "x", "timeout": 0}, "timeout must be a positive number"),
        ({"prompt": "x", "timeout": -1.0}, "timeout must be a positive number"),
        ({"prompt": "x", "timeout": float("nan")}, "timeout must be a positive number"),
        ({"prompt": "x", "timeout": float("inf")}, "timeout must be a positive number"),
        ({"prompt": "x", "timeout": 1e300}, "timeout must be a positive number"),  # no thread can wait that long
        ({"prompt": "x", "timeout": 10**400}, "timeout must be a positive number"),
        ({"prompt": "x", "timeout": "5"}, "timeout must be a positive number"),
        ({"prompt": "x", "timeout": True}, "timeout must be a positive number"),
        ({"prompt": "x", "timeout": 5, "stream": True}, "timeout applies to whole results"),
        ({"prompt": "x", "bootstrap": {"bootstrap_room": 1}}, "bootstrap must be a BootstrapFields, got dict"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerateRequest(**kwargs)


def test_the_longest_timeout_a_thread_can_wait_is_taken():
    assert GenerateRequest("x", timeout=threading.TIMEOUT_MAX).timeout == threading.TIMEOUT_MAX


def test_bootstrap_keywords_are_collected_into_one_value():
    fields = BootstrapFields.from_keywords({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2})
    assert fields == BootstrapFields("h", 1, 2)
    assert fields.given() == {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2}
    assert BootstrapFields.from_keywords({}) is None
    assert BootstrapFields.from_keywords({"bootstrap_room": None}) is None  # a server passes them all, unset too
    assert BootstrapFields(room=0).given() == {"bootstrap_room": 0}  # room 0 is a value
    with pytest.raises(TypeError, match="unexpected keyword argument 'lora_path'"):
        BootstrapFields.from_keywords({"lora_path": "x"})


def test_bootstrap_comes_typed_or_as_keywords_not_both():
    typed = BootstrapFields("h", 1, 2)
    assert bootstrap_of(typed, {}) is typed
    assert bootstrap_of(None, {"bootstrap_room": 2}) == BootstrapFields(room=2)
    assert bootstrap_of(None, {}) is None
    with pytest.raises(ValueError, match="not both"):
        bootstrap_of(typed, {"bootstrap_room": 3})


def test_generate_keeps_sglangs_keywords_and_checks_the_bootstrap_ones(engine):
    """A server that serves requests whole refuses pairing fields however they come; a keyword generate does not
    have is a TypeError, as it is for any function."""
    for pairing in ({"bootstrap_room": 1}, {"bootstrap": BootstrapFields(room=1)}):
        with pytest.raises(ValueError, match="bootstrap_room: bootstrap fields are for prefill and decode servers"):
            engine.generate("x", GOOD, **pairing)
    with pytest.raises(ValueError, match="not both"):
        engine.generate("x", GOOD, bootstrap=BootstrapFields(room=1), bootstrap_room=1)
    with pytest.raises(TypeError, match="no_such_keyword"):
        engine.generate("x", GOOD, no_such_keyword=1)
    out = engine.generate(prompt="x", sampling_params=GOOD, input_ids=None, return_logprob=True, logprob_start_len=-1,
                          top_logprobs_num=1, return_text_in_logprobs=True, stream=False, rid="all-keywords",
                          timeout=60, image_data=None, bootstrap_host=None, bootstrap_port=None, bootstrap_room=None)
    assert out["meta_info"]["id"] == "all-keywords" and len(out["meta_info"]["output_top_logprobs"]) == 4


def test_the_three_shapes_return_what_they_are_typed_to(engine):
    assert isinstance(engine.generate("x", GOOD), dict)
    assert isinstance(engine.generate("x", {**GOOD, "n": 2}), list)  # one prompt, n > 1: a list of n
    assert [len(r["output_ids"]) for r in engine.generate(input_ids=[[5], [6]], sampling_params=GOOD)] == [4, 4]
    assert [c["meta_info"]["finish_reason"] is not None for c in engine.generate("x", GOOD, stream=True)][-1]

    async def run():
        one = await engine.async_generate("x", GOOD)
        many = await engine.async_generate(["x", "y"], GOOD)
        chunks = [c async for c in await engine.async_generate(input_ids=[5], sampling_params=GOOD, stream=True)]
        return one, many, chunks

    one, many, chunks = asyncio.run(run())
    assert isinstance(one, dict) and len(many) == 2 and chunks[-1]["meta_info"]["finish_reason"] is not None


def test_an_error_in_a_stream_is_raised_by_either_reader_and_leaves_nothing_running(engine):
    bad = {**GOOD, "regex": "([a-"}  # the grammar fails to compile in the scheduler: an error item, not a chunk
    with pytest.raises(ValueError, match="regex"):
        list(engine.generate("x", bad, stream=True))

    async def run():
        return [c async for c in await engine.async_generate("x", bad, stream=True)]

    with pytest.raises(ValueError, match="regex"):
        asyncio.run(run())
    assert engine.num_in_flight() == 0


def test_closing_an_async_stream_early_aborts_it(engine):
    async def run():
        stream = await engine.async_generate("the river", {"max_new_tokens": 500, "ignore_eos": True}, stream=True,
                                             rid="async-close")
        await anext(stream)
        await stream.aclose()
        return engine.num_in_flight()

    assert asyncio.run(run()) == 0  # forgotten at once; the abort is on its way to the scheduler
