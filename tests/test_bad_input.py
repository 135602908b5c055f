"""Bad input is a clear ValueError naming the problem, for that request only; the engine keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import EXACT, NO_GRAMMAR
from furcate import EngineArgs, gen
from furcate.grammars import GrammarSpec
from furcate.interpreter.backends.base import wire_sampling
from furcate.runtime.sampling.params import SamplingParams

GOOD = {"max_new_tokens": 4, "temperature": 0}


def nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"not": schema}
    return schema


DEEP_SCHEMA = nested(5000)
DEEP_TEXT = '{"not": ' * 5000 + "{}" + "}" * 5000


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "x", "sampling_params": {"json_schema": {"not": {"maximum": float("nan")}}}}, "NaN"),
        ({"prompt": "x", "sampling_params": {"json_schema": DEEP_SCHEMA}}, "nested too deeply"),
        ({"prompt": "x", "sampling_params": {"json_schema": json.dumps(nested(100)).replace("{}", DEEP_TEXT)}},
         "nested too deeply"),
        ({"prompt": ["fine", ""]}, "prompt 1 is empty"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, 10**9]}, "outside the vocabulary"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": 10**9}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"prompt": "x", "sampling_params": {"min_p": 2}}, "min_p"),
        ({"prompt": "x", "sampling_params": {"temperatur": 1.0}}, "temperatur"),
        ({"prompt": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}}, "min_new_tokens"),
        ({"prompt": "x", "sampling_params": {"stop_token_ids": [10**7]}}, "stop_token_ids"),
        ({"prompt": "x", "sampling_params": {"logit_bias": {"a": 1}}}, "logit_bias"),
        ({"prompt": "x", "sampling_params": {"n": 0}}, "n must be"),
        ({"prompt": "x", "logprob_start_len": -3}, "logprob_start_len"),
        ({"prompt": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"prompt": "x", "input_ids": [1]}, "exactly one"),
        # Each of these once passed validation and hung, crashed deep inside or was silently misread.
        ({"prompt": "x", "sampling_params": {"skip_special_tokens": "false"}}, "skip_special_tokens"),
        ({"prompt": "x", "sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
        ({"prompt": "x", "sampling_params": {"spaces_between_special_tokens": 1}}, "spaces_between_special"),
        ({"prompt": "x", "sampling_params": {"no_stop_trim": None}}, "no_stop_trim"),
        ({"prompt": 123}, "prompt must be"),
        ({"prompt": {"a": 1}}, "prompt must be"),
        ({"prompt": "\ud800"}, "not valid text"),
        ({"prompt": "x", "sampling_params": 5}, "sampling_params must be a dict"),
        ({"prompt": "x", "sampling_params": "abc"}, "sampling_params must be a dict"),
        ({"prompt": "x", "sampling_params": {"stop": 5}}, "stop must be"),
        ({"prompt": "x", "sampling_params": {"stop": {"a": 1}}}, "stop must be"),
        ({"prompt": "x", "sampling_params": {"stop_token_ids": 5}}, "stop_token_ids"),
        ({"prompt": "x", "sampling_params": {"stop_token_ids": [True]}}, "stop_token_ids"),
        ({"prompt": "x", "sampling_params": {"grammar": "x"}}, "unknown sampling parameter"),
        ({"prompt": "x", "sampling_params": {"logit_bias": {1000: float("nan")}}}, "finite"),
        ({"prompt": "x", "sampling_params": {"temperature": float("inf")}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"top_p": float("nan")}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"temperature": 10**400}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"temperature": 1e300}}, "float32"),  # inf in float32: NaN logits
        ({"prompt": "x", "sampling_params": {"stop": ["ok", "\ud800"]}}, "lone surrogate"),  # can never match text
        ({"prompt": "x", "sampling_params": {"stop_regex": "\udfff"}}, "lone surrogate"),
        ({"prompt": "x", "sampling_params": {"n": 10**9}}, "n must be"),
        ({"input_ids": [True, False]}, "input_ids"),
        ({"input_ids": {"a": 1}}, "input_ids must be"),
        ({"prompt": "x", "rid": ["x"]}, "rid"),
        ({"prompt": "x", "return_logprob": "yes"}, "return_logprob"),
        ({"prompt": "x", "return_text_in_logprobs": 1}, "return_text_in_logprobs"),
        ({"prompt": "x", "top_logprobs_num": 5}, "top_logprobs_num needs return_logprob"),
        ({"prompt": "x", "logprob_start_len": 10**6, "return_logprob": True}, "logprob_start_len"),
        ({"prompt": "x", "sampling_params": {"repetition_penalty": 1e-300}}, "repetition_penalty"),
        ({"prompt": ["ok", 5]}, "prompt must be"),
        ({"prompt": []}, "prompt must be"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"input_ids": [[1, "a"]]}, "input_ids"),
        ({"input_ids": [-1]}, "outside the vocabulary"),
        ({"prompt": ["a", "b"], "sampling_params": [GOOD]}, "sampling_params for 2 prompts"),
        ({"prompt": ["a", "b"], "sampling_params": [GOOD, 5]}, "sampling_params must be a dict"),
        ({"prompt": "x", "sampling_params": {"stop": ["ok", ""]}}, "stop must be"),
        ({"prompt": "x", "sampling_params": {"stop_regex": "(["}}, "stop_regex"),
        ({"prompt": "x", "sampling_params": {"min_p": -1}}, "min_p"),
        ({"prompt": "x", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
        ({"prompt": "x", "sampling_params": {"presence_penalty": float("nan")}}, "presence_penalty"),
        ({"prompt": "x", "sampling_params": {"sampling_seed": -1}}, "sampling_seed"),
        ({"prompt": "x", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
        ({"prompt": "x", "sampling_params": {"regex": 5}}, "regex"),
        ({"prompt": "x", "sampling_params": {"choices": []}}, "choices"),
        ({"prompt": "x", "sampling_params": {"regex": "a", "choices": ["a"]}}, "at most one"),
        ({"prompt": "x", "sampling_params": {"regex": "a", "grammar": GrammarSpec("regex", "b")}}, "at most one"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "sampling_params": {"stop": ["s"] * 65}}, "at most 64"),
        ({"prompt": ["x"] * 9, "sampling_params": {"n": 1000}}, "at most 8192 requests"),
    ],
)
def test_bad_request_raises_and_engine_keeps_serving(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**{"sampling_params": GOOD, **kwargs})
    assert len(engine.generate("still serving", GOOD)["output_ids"]) == 4


def test_prompt_longer_than_context_is_rejected(engine, tokenizer):
    too_long = [5] * 1024  # the tiny models' context length is 1024
    with pytest.raises(ValueError, match="prompt has 1024 tokens"):
        engine.generate(input_ids=too_long, sampling_params=GOOD)


def test_bad_engine_arguments_name_the_field():
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineArgs(schedule_policy="fastest")
    with pytest.raises(ValueError, match="max_total_tokens"):
        EngineArgs(max_total_tokens=1)
    with pytest.raises(TypeError):
        EngineArgs(not_an_argument=1)
    for pending in (0, -3, True, 2.5, "8", float("nan")):
        with pytest.raises(ValueError, match="max_pending_requests must be an integer >= 1"):
            EngineArgs(max_pending_requests=pending)
    for field in ("model_path", "tokenizer_path", "speculative_draft_model_path"):
        with pytest.raises(ValueError, match=f"{field} must be a path .* got list"):
            EngineArgs(**{field: ["/tmp"]})
    assert EngineArgs(model_path=Path("/tmp"), tokenizer_path=Path("/tmp")).model_path == "/tmp"


def test_numpy_integer_ids_are_token_ids(engine):
    import numpy as np

    ids = [5, 17, 300]
    expected = engine.generate(input_ids=ids, sampling_params=GOOD)["output_ids"]
    assert engine.generate(input_ids=list(np.array(ids)), sampling_params=GOOD)["output_ids"] == expected


def test_an_unknown_rpc_is_an_error_for_the_caller_only(engine):
    with pytest.raises(ValueError, match="unknown RPC method 'no_such_call'"):
        engine._rpc("no_such_call")
    assert engine.check_integrity()
    assert len(engine.generate("still serving", GOOD)["output_ids"]) == 4


def test_a_list_with_one_bad_item_aborts_the_rest(engine):
    import time

    long = {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(ValueError, match="regex"):
        engine.generate(["a long one", "another long one", "bad"], [long, long, {**long, "regex": "([a-"}])
    deadline = time.monotonic() + 10
    while engine.get_stats()["running"] + engine.get_stats()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get_stats()["running"] == 0  # aborted, not left to run 500 tokens each

    import asyncio

    async def run():
        await engine.async_generate(["a long one", "bad"], [long, {**long, "regex": "([a-"}])

    with pytest.raises(ValueError, match="regex"):
        asyncio.run(run())
    while engine.get_stats()["running"] + engine.get_stats()["waiting"] and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert engine.get_stats()["running"] == 0


def _outcome_without_hanging(call, limit_s: float):
    """Run `call` on a thread and give back what it raised (None if nothing). A guard against a hang, with a
    generous limit; not a speed measurement."""
    import threading

    outcome: list = []

    def run():
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert outcome, f"still blocked after {limit_s}s: the engine hangs instead of failing"
    return outcome[0]


def test_a_dead_scheduler_fails_waiting_and_new_requests_at_once(tiny_model_dirs):
    from furcate import Engine

    engine = Engine(str(tiny_model_dirs["llama"]), **EXACT, **NO_GRAMMAR, max_total_tokens=2000, torch_num_threads=1)
    assert engine.is_alive()
    stream = engine.generate("the river", {"max_new_tokens": 900, "ignore_eos": True}, stream=True)
    next(stream)
    engine._process.kill()
    error = _outcome_without_hanging(lambda: [None for _ in stream], 60)
    assert isinstance(error, RuntimeError) and "scheduler process died" in str(error)
    assert not engine.is_alive()
    with pytest.raises(RuntimeError, match="cannot serve"):
        engine.generate("again", GOOD)
    # Before the fix shutdown() waited 30 s for the dead process to answer; now it must not wait on it at all.
    assert _outcome_without_hanging(engine.shutdown, 20) is None


def test_after_the_sweep_the_engine_still_answers_like_hf(engine, hf_reference, tokenizer):
    ids = tokenizer.encode("the river of stone")
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == hf_reference("llama").greedy(ids, 8)
    assert engine.check_integrity()


def test_a_timeout_aborts_what_is_unfinished(engine):
    import asyncio
    import time

    long = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(TimeoutError):
        engine.generate(["slow one", "slow two"], long, timeout=0.3)

    async def run():
        await engine.async_generate("slow three", long, timeout=0.3)

    with pytest.raises(TimeoutError):
        asyncio.run(run())
    with pytest.raises(ValueError, match="timeout"):
        engine.generate("x", GOOD, timeout=float("nan"))
    deadline = time.monotonic() + 10
    while engine.get_stats()["running"] + engine.get_stats()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.get_stats()["running"] == 0
    assert len(engine.generate("still serving", GOOD, timeout=60)["output_ids"]) == 4


def test_a_grammar_built_by_gen_is_taken_as_built_and_flattened_only_for_the_wire():
    built = gen("x", json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}).constraint
    params = SamplingParams.from_dict({"max_new_tokens": 4, "grammar": built})
    assert params.grammar is built
    assert wire_sampling({"max_new_tokens": 4, "grammar": built}) == {"max_new_tokens": 4, "json_schema": built.spec}
    assert SamplingParams.from_dict(wire_sampling({"grammar": built})).grammar == built


def test_a_top_k_beyond_int64_keeps_every_token(engine):
    # Any integer is a valid top_k >= 1; one too large for a torch tensor once killed the scheduler.
    # It samples as a top_k of the whole vocabulary does.
    params = {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 1}
    whole = engine.generate("a b c", {**params, "top_k": engine.info.vocab_size})["output_ids"]
    assert engine.generate("a b c", {**params, "top_k": 2**70})["output_ids"] == whole


@pytest.mark.parametrize("field", ["dtype", "speculative_algorithm", "grammar_backend"])
def test_a_list_where_a_choice_belongs_names_the_field(field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: ["NGRAM"]})
