"""Engine surface: streaming (sync and async), abort, stats, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from conftest import EXACT, NO_GRAMMAR, assert_pool_free
from furcate import Engine

PARAMS = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_sync_stream_is_cumulative_and_ends_with_the_full_result(engine):
    final = engine.generate("the river of stone", PARAMS, return_logprob=True)
    chunks = list(engine.generate("the river of stone", PARAMS, return_logprob=True, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == final["text"]
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == final["meta_info"]["finish_reason"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    streamed = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [t for _, t, _ in streamed] == final["output_ids"]


def test_stream_holds_back_text_that_may_become_a_stop_string(engine):
    text = engine.generate("the river of stone", PARAMS)["text"]
    stop = text[4:8]
    chunks = list(engine.generate("the river of stone", {**PARAMS, "stop": stop}, stream=True))
    assert all(stop not in c["text"] for c in chunks)
    assert chunks[-1]["text"] == text[: text.index(stop)]


def test_async_stream_and_async_batch(engine):
    async def run():
        chunks = [c async for c in await engine.async_generate("quiet hills", PARAMS, stream=True)]
        batch = await engine.async_generate(["quiet hills", "a"], PARAMS)
        return chunks, batch

    chunks, batch = asyncio.run(run())
    assert chunks[-1]["output_ids"] == batch[0]["output_ids"]
    assert len(batch) == 2


def test_closing_a_stream_early_aborts_and_frees_memory(engine):
    stream = engine.generate("the river", {**PARAMS, "max_new_tokens": 500}, stream=True)
    next(stream)
    stream.close()
    for _ in range(100):
        if engine.get_stats()["running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert_pool_free(engine)


def test_abort_by_rid_finishes_with_abort(engine):
    async def run():
        stream = await engine.async_generate("the river", {**PARAMS, "max_new_tokens": 500}, stream=True,
                                             rid="to-abort")
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 2:
                engine.abort("to-abort")
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(chunks[-1]["output_ids"]) < 500


def test_stats_report_forward_time(engine):
    before = engine.get_stats()
    engine.generate("the river", PARAMS)
    after = engine.get_stats()
    assert after["forward_calls"] > before["forward_calls"]
    assert after["forward_seconds"] > before["forward_seconds"]


def test_pool_sized_from_memory_then_shutdown_then_generate_raises(tiny_model_dirs):
    engine = Engine(str(tiny_model_dirs["qwen2"]), **EXACT, **NO_GRAMMAR, mem_fraction_static=0.01,
                    torch_num_threads=1)
    assert engine.get_stats()["max_total_tokens"] >= 256
    assert engine.generate("hi", PARAMS)["meta_info"]["completion_tokens"] == 10
    engine.shutdown()
    assert engine._process.poll() is not None
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hi", PARAMS)


def test_an_unstreamed_request_reaches_the_engine_twice_and_ends_as_its_stream_does(engine):
    """Nobody reads a non-streamed request's partial output: its first tokens arrive at once (they time the first
    token) and the rest when it ends, and its result is what the same request's stream adds up to."""
    params = {**PARAMS, "max_new_tokens": 12}
    logprob_args = {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    ended = []
    engine.request_observers.append(ended.append)
    try:
        final = engine.generate("the river of stone", params, **logprob_args)
        chunks = list(engine.generate("the river of stone", params, stream=True, **logprob_args))
    finally:
        engine.request_observers.remove(ended.append)
    unstreamed, streamed = ended
    # One sample per token after the first either way; unstreamed they are all the one mean of a single arrival.
    assert unstreamed.first_token_at is not None and len(set(unstreamed.inter_token_latencies)) == 1
    assert len(unstreamed.inter_token_latencies) == len(streamed.inter_token_latencies) == len(final["output_ids"]) - 1
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    meta = final["meta_info"]
    assert meta["finish_reason"] == chunks[-1]["meta_info"]["finish_reason"]
    assert meta["completion_tokens"] == len(final["output_ids"])
    assert meta["prompt_tokens"] == chunks[-1]["meta_info"]["prompt_tokens"]
    for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
        joined = [entry for chunk in chunks for entry in chunk["meta_info"][key]]
        assert len(joined) == len(meta[key]), key
        assert str(_without_values(joined)) == str(_without_values(meta[key])), key


def _without_values(entries: list) -> list:
    """Logprob triples (or lists of them) with the logprob dropped: token ids and texts compare exactly."""
    return [entry[1:] if isinstance(entry, tuple) else _without_values(entry or []) for entry in entries]


def test_an_aborted_unstreamed_request_returns_the_tokens_it_had(engine):
    params = {**PARAMS, "max_new_tokens": 300}
    whole = engine.generate("the river", params)["output_ids"]

    async def run():
        waiter = asyncio.ensure_future(engine.async_generate("the river", params, rid="unstreamed-abort"))
        while engine.get_stats()["running"] == 0:  # accepted and decoding: its first tokens are out
            await asyncio.sleep(0.01)
        engine.abort("unstreamed-abort")
        return await waiter

    result = asyncio.run(run())
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["output_ids"] == whole[: len(result["output_ids"])]
    assert len(result["output_ids"]) < 300
