"""enable_torch_compile: decode batches of up to torch_compile_max_bs run one compiled layer graph on CPU, and
greedy output stays HF transformers' token for token (float32), across batch sizes, sliding windows, q/k norms,
the radix cache and a batch larger than the compiled sizes."""

from __future__ import annotations

import pytest

from conftest import EXACT, NO_GRAMMAR, assert_pool_free, engines_side_by_side
from furcate.runtime.config import EngineArgs
from test_greedy_matches_hf import make_prompts

# qwen3: q/k norms and a head_dim unlike hidden/heads; mistral: a 24-token sliding window the prompts cross.
ARCHS = ("qwen3", "mistral")


@pytest.fixture(scope="module")
def compiled_engines(tiny_model_dirs):
    args = {**EXACT, **NO_GRAMMAR, "max_total_tokens": 3000, "max_running_requests": 6, "torch_num_threads": 2,
            "enable_torch_compile": True, "torch_compile_max_bs": 4}
    with engines_side_by_side(*((str(tiny_model_dirs[arch]), args) for arch in ARCHS)) as engines:
        yield dict(zip(ARCHS, engines))


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_decode_greedy_equals_hf(arch, compiled_engines, hf_reference, tokenizer):
    engine, hf = compiled_engines[arch], hf_reference(arch)
    prompts = make_prompts(6, seed=11 + ARCHS.index(arch))
    lengths = [3 + 5 * i for i in range(len(prompts))]
    expected = [hf.greedy(tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in lengths]
    compiled_before = engine.get_stats()["graph_forward_calls"]
    # One at a time (batch 1), then all six at once: batches of 6 down to 1, above and within the compiled sizes.
    assert [engine.generate(p, s)["output_ids"] for p, s in zip(prompts, params)] == expected
    assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected
    # Again with every prompt's KV cached by the radix tree: decode reads slots shared with finished requests.
    assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected
    # Each decode step of a batch of up to 4 ran compiled: at least the first prompt's alone.
    assert engine.get_stats()["graph_forward_calls"] - compiled_before >= lengths[0] - 1
    assert_pool_free(engine)


def test_compiled_decode_refuses_a_bad_max_batch_size():
    with pytest.raises(ValueError, match="torch_compile_max_bs"):
        EngineArgs(torch_compile_max_bs=0)
