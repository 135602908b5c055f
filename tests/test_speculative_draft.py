"""Draft-model (STANDALONE) speculative decoding: greedy output is token for token the output without it, whatever
the draft model; a draft model equal to the target has every draft accepted; sampled tokens keep the target's
distribution; grammars constrain as without it; a bad draft model is refused at engine start; and the draft
model's own KV pool is whole again once requests finish or are aborted.

Targets are the tiny llama model; drafts are the same model (every draft right), its first layer alone (a
layer-truncated draft: right often, wrong often) and the tiny qwen2 model (an unrelated draft: mostly wrong).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import pytest
import torch

from benchmarks.speculative import truncated_model
from conftest import EXACT, NO_GRAMMAR, TINY_POOL_TOKENS, assert_pool_free, shut_down, start_side_by_side
from furcate import Engine
from furcate.runtime.config import EngineArgs
from test_greedy_matches_hf import make_prompts
from tiny_models import build_tiny_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}
COMMON = {**EXACT, "max_total_tokens": TINY_POOL_TOKENS, "torch_num_threads": 2}
GRAMMAR = {"grammar_backend": "xgrammar"}  # one backend's tables: the engine starts faster than with auto's


def standalone(draft: str, **more) -> dict:
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft, **more}


@pytest.fixture(scope="module")
def truncated_dir(tiny_model_dirs, tmp_path_factory) -> str:
    return str(truncated_model(tiny_model_dirs["llama"], tmp_path_factory.mktemp("draft") / "llama1", 1))


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, truncated_dir):
    """A plain llama engine and speculative ones drafting with: llama itself; its first layer (grammars on);
    qwen2, on a 64-token draft pool and a 256-token target pool that under-reserves outputs, so requests retract
    and some find no draft room."""
    llama, qwen = str(tiny_model_dirs["llama"]), str(tiny_model_dirs["qwen2"])
    started = start_side_by_side(
        (llama, {**COMMON, **GRAMMAR}),
        (llama, {**COMMON, **NO_GRAMMAR, **standalone(llama)}),
        (llama, {**COMMON, **GRAMMAR, **standalone(truncated_dir)}),
        (llama, {**COMMON, **NO_GRAMMAR, **standalone(qwen, speculative_draft_max_total_tokens=64),
                 "max_total_tokens": 256, "init_new_token_ratio": 0.1, "min_new_token_ratio": 0.05}),
    )
    yield dict(zip(("plain", "self", "truncated", "qwen2"), started))
    shut_down(started)


def spec_counts(results: list[dict]) -> tuple[int, int]:
    return (sum(r["meta_info"]["spec_draft_token_num"] for r in results),
            sum(r["meta_info"]["spec_accept_token_num"] for r in results))


def assert_draft_pool_free(engine: Engine) -> None:
    stats = engine.get_stats()
    assert stats["spec_draft_kv_available"] == stats["spec_draft_max_total_tokens"], stats
    assert stats["spec_draft_req_slots_available"] == stats["max_running_requests"], stats


def shared_prefix_prompts() -> list[str]:
    """8 prompts: 4 sharing a long prefix, 4 of their own lengths."""
    words = make_prompts(8, seed=21)
    prefix = " ".join(words[0].split()[:30] or ["the"])
    return [f"{prefix} {w.split()[0] if w else 'x'} {i}" for i, w in enumerate(words[:4])] + words[4:]


# -- greedy equality -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["self", "truncated", "qwen2"])
def test_greedy_batch_equals_plain(name, engines):
    """A batch of 8 with shared prefixes, then the same batch again (served from the prefix cache)."""
    prompts = shared_prefix_prompts()
    params = [{**GREEDY, "max_new_tokens": 10 + 3 * i} for i in range(len(prompts))]
    engine = engines[name]
    before = engine.get_stats()
    plain = engines["plain"].generate(prompts, params)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    want = [r["output_ids"] for r in plain]
    assert [r["output_ids"] for r in first] == want
    assert [r["output_ids"] for r in again] == want
    assert sum(r["meta_info"]["cached_tokens"] for r in again) > sum(r["meta_info"]["cached_tokens"] for r in first)
    drafted, accepted = spec_counts(first + again)
    after = engine.get_stats()
    # One draft forward per draft position for the whole batch, never one per request.
    draft_forwards = after["spec_draft_forward_calls"] - before["spec_draft_forward_calls"]
    assert 0 < draft_forwards <= 4 * (after["forward_calls"] - before["forward_calls"])
    if name == "self":
        assert accepted == drafted > 0
    else:
        assert drafted > accepted, "no rejected drafts: the verify path was not exercised"
    if name == "truncated":
        assert accepted > 0
    if name == "qwen2":
        assert after["num_retractions"] > 0, "the small pool was meant to force retraction"
        undrafted = [r for r in first if r["meta_info"]["spec_draft_token_num"] == 0]
        assert 0 < len(undrafted) < len(first), "the 64-token draft pool was meant to fit some requests only"
    assert_pool_free(engine)
    assert_draft_pool_free(engine)


def test_a_draft_equal_to_the_target_is_always_accepted(engines):
    prompts = ["a b c d", "the quick brown fox jumps over", "one"]
    out = engines["self"].generate(prompts, {**GREEDY, "max_new_tokens": 21})
    for r in out:
        meta = r["meta_info"]
        assert meta["spec_accept_rate"] == 1.0, meta
        assert meta["spec_accept_length"] == 5.0, meta  # 20 tokens after the first: 4 steps of 4 drafts + 1
    assert_draft_pool_free(engines["self"])


# -- sampling, grammars --------------------------------------------------------------------------------------


def test_sampled_tokens_keep_the_target_distribution(engines, hf_reference, tokenizer):
    """The second output token (the first a draft proposes) of many seeded requests: its frequencies are the
    target's (HF's softmax at the temperature, top-k filtered, given each request's first token), with drafts
    both accepted and rejected. Accepting every draft would put ~0.5 of them on the draft's argmax instead."""
    prompt = tokenizer.encode("the old man and the sea")
    trials, temperature, top_k = 1200, 0.7, 4
    params = [{"temperature": temperature, "top_k": top_k, "max_new_tokens": 3, "ignore_eos": True,
               "sampling_seed": seed} for seed in range(trials)]
    out = engines["truncated"].generate(input_ids=[prompt] * trials, sampling_params=params)
    drafted, accepted = spec_counts(out)
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    hf = hf_reference("llama")
    firsts = [r["output_ids"][0] for r in out]
    given = {first: target_probs(hf.logprobs(prompt + [first])[-1], temperature, top_k) for first in set(firsts)}
    expected = torch.stack([given[first] for first in firsts]).mean(dim=0)
    seconds = torch.tensor([r["output_ids"][1] for r in out])
    observed = torch.bincount(seconds, minlength=len(expected)) / trials
    assert 0.5 * (observed - expected).abs().sum() < 0.08
    assert_draft_pool_free(engines["truncated"])


def target_probs(logprobs: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    probs = torch.softmax(logprobs / temperature, dim=-1)
    kept = torch.zeros_like(probs)
    top = probs.topk(top_k)
    kept[top.indices] = top.values
    return kept / kept.sum()


def test_constrained_output_equals_plain(engines):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    regex = r"(red|green|blue)( (red|green|blue)){11}"
    params = [{**GREEDY, "max_new_tokens": 60, "regex": regex}, {**GREEDY, "max_new_tokens": 60, "json_schema":
                                                                 json.dumps(schema)}]
    prompts = ["colors: red green red green red green blue", "a person:"]
    plain = engines["plain"].generate(prompts, params)
    spec = engines["truncated"].generate(prompts, params)
    assert [r["text"] for r in spec] == [r["text"] for r in plain]
    assert re.fullmatch(regex, spec[0]["text"])
    assert spec_counts(spec)[0] > 0
    assert_pool_free(engines["truncated"])
    assert_draft_pool_free(engines["truncated"])


# -- the draft model's memory --------------------------------------------------------------------------------


def test_abort_mid_generation_frees_the_draft_pool(engines):
    engine = engines["truncated"]

    async def run() -> list[dict]:
        stream = await engine.async_generate("once upon a time", sampling_params={**GREEDY, "max_new_tokens": 400},
                                             stream=True, rid="draft-abort")
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                assert engine.get_stats()["spec_draft_kv_available"] < engine.get_stats()[
                    "spec_draft_max_total_tokens"]
                engine.abort("draft-abort")
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert_pool_free(engine)
    assert_draft_pool_free(engine)


# -- configuration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    ({"speculative_algorithm": "STANDALONE"}, "needs speculative_draft_model_path"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": ""}, "needs speculative_draft"),
    ({"speculative_draft_model_path": "/some/model"}, "only with speculative_algorithm='STANDALONE'"),
    ({**standalone("x"), "speculative_draft_max_total_tokens": -1}, "speculative_draft_max_total_tokens must"),
    ({**standalone("x"), "speculative_draft_max_total_tokens": float("nan")}, "speculative_draft_max_total_tokens"),
    ({**standalone("x"), "speculative_draft_max_total_tokens": True}, "speculative_draft_max_total_tokens"),
    ({**standalone("x"), "speculative_num_draft_tokens": float("nan")}, "speculative_num_draft_tokens"),
    ({**standalone("x"), "speculative_num_draft_tokens": -3}, "speculative_num_draft_tokens"),
    ({**standalone("x"), "speculative_draft_model_quantization": "int3"}, "speculative_draft_model_quantization"),
    ({**standalone("x"), "disable_overlap_schedule": False}, "plain loop only"),
])
def test_bad_config_is_refused(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**args)


def test_bad_draft_models_are_refused_at_engine_start(tiny_model_dirs, default_model_dir, tmp_path):
    """Before the scheduler starts, each with a ValueError naming the path."""
    small_vocab = build_tiny_model("llama", tmp_path / "small_vocab", default_model_dir, vocab_size=1000)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(tiny_model_dirs["llama"] / "config.json", corrupt / "config.json")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + bytes(60))
    cases = [(tmp_path / "missing", "cannot be loaded"), (small_vocab, "has vocab_size 1000, the target model 49152"),
             (corrupt, "cannot be loaded"), (bad_gguf, "cannot be loaded")]
    target = str(tiny_model_dirs["llama"])
    for path, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            Engine(target, **COMMON, **NO_GRAMMAR, **standalone(str(path)))
    with pytest.raises(ValueError, match="quantization is 'gguf'"):
        Engine(target, **COMMON, **NO_GRAMMAR, **standalone(target), speculative_draft_model_quantization="gguf")


def test_a_seq_keeps_what_the_target_accepted():
    """sync_point: the synced tokens, then drafts as far as the request's tokens took them; never the newest."""
    from furcate.runtime.speculative.draft_model import DraftSeq, StandaloneDrafter

    seq = DraftSeq(req=None, slot=0, tokens=[5, 6, 7, 1, 2, 3], synced=3)  # K/V of prompt 5, 6, 7, drafts 1, 2, 3
    assert StandaloneDrafter.sync_point(seq, [5, 6, 7, 1, 2, 8]) == 5  # 1 and 2 accepted, then 8
    assert StandaloneDrafter.sync_point(seq, [5, 6, 7, 4]) == 3  # the first draft rejected
    assert StandaloneDrafter.sync_point(seq, [5, 6, 7, 1, 2, 3, 4, 9]) == 6  # all accepted: feed 4, 9
    assert StandaloneDrafter.sync_point(seq, [5, 6, 7, 1, 2, 3]) == 5  # the newest is fed again for its logits
