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
