"""The CPU kernel switches are engine arguments (runtime/config.py), their FURCATE_* variables overrides: the
scheduler process applies them before any kernel loads, an engine started with a kernel off runs torch's path
(and says so in its statistics), and its greedy output is still HF's."""

from __future__ import annotations

import argparse

import pytest

from conftest import EXACT, NO_GRAMMAR, assert_pool_free, engine_starting
from furcate.runtime.config import KERNEL_SWITCHES, EngineArgs
from furcate.runtime.kernels import fused_elementwise, paged_attention


@pytest.fixture(autouse=True)
def no_switch_in_the_environment(monkeypatch):
    for variable in KERNEL_SWITCHES.values():
        monkeypatch.delenv(variable, raising=False)


def test_the_defaults_set_nothing():
    assert EngineArgs().kernel_environment() == {}


def test_each_switch_names_its_variable():
    args = EngineArgs(paged_attention_kernel=False, fused_elementwise_kernel=False, block_gemv_kernel=False,
                      native_ops=False, huge_pages=False, packed_linear="on", dense_gemv="off")
    assert args.kernel_environment() == {
        "FURCATE_PAGED_ATTENTION": "0", "FURCATE_FUSED_ELEMENTWISE": "0", "FURCATE_BLOCK_GEMV": "0",
        "FURCATE_NATIVE_OPS": "0", "FURCATE_HUGE_PAGES": "0", "FURCATE_PACKED_LINEAR": "1",
        "FURCATE_DENSE_GEMV": "0"}
    assert EngineArgs(packed_linear="off", dense_gemv="on").kernel_environment() == {
        "FURCATE_PACKED_LINEAR": "0", "FURCATE_DENSE_GEMV": "1"}


def test_the_environment_overrides_the_argument(monkeypatch):
    monkeypatch.setenv("FURCATE_PAGED_ATTENTION", "1")
    assert EngineArgs(paged_attention_kernel=False, huge_pages=False).kernel_environment() == {
        "FURCATE_HUGE_PAGES": "0"}


@pytest.mark.parametrize("field, value", [("paged_attention_kernel", "no"), ("huge_pages", 0),
                                          ("native_ops", None), ("packed_linear", "sometimes"),
                                          ("dense_gemv", True)])
def test_a_bad_value_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value})


def test_the_switches_are_flags():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--no-paged-attention-kernel", "--packed-linear", "off"]))
    assert args.paged_attention_kernel is False and args.packed_linear == "off" and args.huge_pages is True


@pytest.mark.skipif(not (paged_attention.available() and fused_elementwise.available()),
                    reason="the C kernels do not build on this machine, so turning them off changes nothing")
def test_an_engine_with_its_kernels_off_runs_torch_and_still_matches_hf(llama_engine, tiny_model_dirs,
                                                                         hf_reference, tokenizer):
    assert llama_engine.get_stats()["native_kernels"] == {"paged_attention": True, "fused_elementwise": True}
    prompt = "the river of stone light over quiet hills"
    with engine_starting(str(tiny_model_dirs["llama"]), **EXACT, **NO_GRAMMAR, max_total_tokens=256,
                         torch_num_threads=2, paged_attention_kernel=False,
                         fused_elementwise_kernel=False) as started:
        expected = hf_reference("llama").greedy(tokenizer.encode(prompt), 12)
        engine = started()
        out = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert engine.get_stats()["native_kernels"] == {"paged_attention": False, "fused_elementwise": False}
        assert out["output_ids"] == expected
        assert_pool_free(engine)
