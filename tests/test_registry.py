"""Named choices: one registry feeds config validation and CLI choices; attention_backend "auto" resolves per
device, and a GPU-only backend named where it cannot run is an error saying why."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from furcate.grammars import auto as grammar_auto
from furcate.grammars import registry as grammar_registry
from furcate.runtime import registry
from furcate.runtime.attention import select
from furcate.runtime.attention.torch_native import TorchNativeAttention
from furcate.runtime.config import EngineArgs, ServerArgs, add_dataclass_args
from furcate.runtime.disaggregation import registry as disaggregation_registry
from furcate.runtime.speculative import registry as speculative_registry

ROOT = Path(__file__).resolve().parents[1]
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


@pytest.fixture
def machine(monkeypatch):
    """Set whether torch sees CUDA and whether flashinfer is installed."""
    def set_machine(cuda: bool, flashinfer: bool) -> None:
        monkeypatch.setattr(select, "cuda_available", lambda: cuda)
        monkeypatch.setattr(select, "flashinfer_importable", lambda: flashinfer)
    return set_machine


@pytest.fixture
def no_gpu_backends(monkeypatch):
    """The registry as in a build without flashinfer or triton, whatever this machine has installed."""
    entries = {name: entry for name, entry in registry._ENTRIES[select.KIND].items() if name not in select.CUDA_ONLY}
    monkeypatch.setitem(registry._ENTRIES, select.KIND, entries)


@pytest.fixture
def gpu_backends_built(no_gpu_backends):
    """Stand-ins for the flashinfer and triton backends (test-only; never shipped)."""
    for name in select.CUDA_ONLY:
        registry.register(select.KIND, name, f"{name}_backend:Backend")


def test_auto_is_the_default_and_resolves_to_torch_native_on_cpu(machine):
    machine(cuda=False, flashinfer=False)
    assert EngineArgs().attention_backend == "auto"
    assert select.resolve_attention_backend("auto", "cpu") == "torch_native"
    assert isinstance(select.make_attention_backend("auto", "cpu"), TorchNativeAttention)
    assert isinstance(select.make_attention_backend("torch_native", "cpu"), TorchNativeAttention)


@pytest.mark.parametrize("cuda, flashinfer, device, expected", [
    (True, True, "cuda", "flashinfer"),
    (True, True, "cuda:1", "flashinfer"),
    (True, False, "cuda", "triton"),
    (True, True, "cpu", "torch_native"),  # CUDA present but not asked for
    (False, True, "cuda", "torch_native"),  # asked for, but torch sees none
])
def test_auto_prefers_flashinfer_then_triton_on_cuda(machine, gpu_backends_built, cuda, flashinfer, device, expected):
    machine(cuda=cuda, flashinfer=flashinfer)
    assert select.resolve_attention_backend("auto", device) == expected


def test_auto_on_cuda_falls_back_to_torch_native_while_no_gpu_backend_is_built(machine, no_gpu_backends):
    machine(cuda=True, flashinfer=True)
    assert select.resolve_attention_backend("auto", "cuda") == "torch_native"


@pytest.mark.parametrize("cuda, flashinfer, device, name, reason", [
    (False, False, "cpu", "flashinfer", "runs only on CUDA, and device is 'cpu'"),
    (False, False, "cpu", "triton", "runs only on CUDA, and device is 'cpu'"),
    (False, True, "cuda", "flashinfer", "torch sees no CUDA device"),
    (True, False, "cuda", "flashinfer", "needs the flashinfer package"),
    (True, True, "cuda", "flashinfer", "not available in this build"),
    (True, False, "cuda", "triton", "not available in this build"),
])
def test_a_gpu_backend_where_it_cannot_run_says_why(machine, no_gpu_backends, cuda, flashinfer, device, name,
                                                   reason):
    machine(cuda=cuda, flashinfer=flashinfer)
    with pytest.raises(ValueError, match=reason):
        EngineArgs(attention_backend=name, device=device)


def test_a_built_gpu_backend_is_accepted_on_cuda(machine, gpu_backends_built):
    machine(cuda=True, flashinfer=True)
    assert EngineArgs(attention_backend="flashinfer", device="cuda").attention_backend == "flashinfer"
    assert select.resolve_attention_backend("triton", "cuda") == "triton"


@pytest.mark.parametrize("field, value", [
    ("attention_backend", "sdpa"), ("schedule_policy", "fastest"), ("grammar_backend", "regexp"),
    ("dtype", "int3"), ("disaggregation_mode", "both"),
])
def test_unknown_names_are_refused_listing_the_registered_ones(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be one of \(.*\), got '{value}'"):
        EngineArgs(**{field: value})


def test_server_choices_are_checked_by_the_same_registry():
    with pytest.raises(ValueError, match=r"router_policy must be one of \('cache_aware'"):
        ServerArgs(router_policy="fastest")


def test_registry_rejects_a_second_target_under_a_taken_name(monkeypatch):
    monkeypatch.setitem(registry._ENTRIES, "widget", {})
    registry.register("widget", "a", "x:A")
    registry.register("widget", "a", "x:A")  # the same entry again (a module imported twice) is fine
    with pytest.raises(ValueError, match="already registered"):
        registry.register("widget", "a", "y:B")
    registry.register("widget", "plain")
    with pytest.raises(ValueError, match="names no implementation"):
        registry.resolve("widget", "plain")


def _choices(cls: type) -> dict[str, tuple]:
    parser = argparse.ArgumentParser()
    add_dataclass_args(cls, parser)
    return {action.dest: action.choices for action in parser._actions if action.choices is not None}


def test_cli_choices_come_from_the_registry(gpu_backends_built):
    choices = _choices(EngineArgs)
    assert choices["attention_backend"] == ("auto", "torch_native", "flashinfer", "triton")
    for field in ("dtype", "quantization", "schedule_policy", "grammar_backend", "disaggregation_mode",
                  "disaggregation_transfer_backend"):
        assert choices[field] == registry.names(field)
    assert _choices(ServerArgs)["router_policy"] == registry.names("router_policy")


def test_cli_lists_only_the_attention_backends_this_build_has():
    installed = (("triton",) if TRITON_INSTALLED else ()) + (("flashinfer",) if select.flashinfer_importable() else ())
    assert _choices(EngineArgs)["attention_backend"] == ("auto", "torch_native", *installed)


def test_triton_is_registered_exactly_when_the_triton_package_is_installed():
    assert registry.is_registered(select.KIND, "triton") == TRITON_INSTALLED


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
def test_auto_on_cuda_without_flashinfer_picks_triton(machine):
    from furcate.runtime.attention.triton_backend import TritonAttention

    machine(cuda=True, flashinfer=False)
    assert select.resolve_attention_backend("auto", "cuda") == "triton"
    assert isinstance(select.make_attention_backend("auto", "cuda"), TritonAttention)
    assert isinstance(select.make_attention_backend("triton", "cuda:0"), TritonAttention)


def test_grammar_backend_choices_are_the_grammar_table():
    assert registry.names("grammar_backend") == tuple(grammar_registry.BACKENDS)


def test_auto_draws_only_on_registered_grammar_backends():
    assert set(grammar_auto.BACKENDS) <= set(grammar_registry.BACKENDS) - {"auto", grammar_registry.NONE}


def test_an_unknown_grammar_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown grammar_backend 'regexp'"):
        grammar_registry.make_backend("regexp", None, 0, [], 1.0)


def test_naming_a_pluggable_part_imports_none_of_its_implementations():
    """Config validation reads every registry; the backends' libraries load only when one is built."""
    code = ("import sys; from furcate.runtime.config import EngineArgs; "
            "EngineArgs(grammar_backend='xgrammar', speculative_algorithm='NGRAM', disaggregation_mode='null', "
            "disaggregation_transfer_backend='nixl'); "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'xgrammar', 'llguidance', 'outlines_core', 'mooncake', 'nixl') "
            "or m.endswith(('_backend', '.ngram', '.draft_model', '.prefill', '.decode', '.transfer'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT.parent if (ROOT.parent / "furcate").exists() else None).stdout.split()
    assert loaded == []


def test_speculative_and_disaggregation_choices_register_beside_their_implementations():
    assert registry.names(speculative_registry.KIND) == ("NGRAM", "STANDALONE")
    assert registry.names(disaggregation_registry.MODE) == ("null", "prefill", "decode")
    assert registry.names(disaggregation_registry.TRANSFER_BACKEND) == ("mooncake", "nixl")
    from furcate.runtime.speculative.ngram import NgramDrafter

    assert registry.resolve(speculative_registry.KIND, "NGRAM") is NgramDrafter
