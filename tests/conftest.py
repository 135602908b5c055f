"""Shared fixtures: the default model directory, tiny random models of each architecture, engines over them; and
the collection rule that keeps pytest from importing the repository root a second time."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Generic, TypeVar

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from furcate import Engine
from furcate.runtime.engine.launch import keep_a_spare_scheduler
from furcate.runtime.kernels import native_build
from furcate.runtime.model.weights.default_model import prepare_default_model
from furcate.runtime.server.server_process import ServerProcess
from tiny_models import CONFIGS, build_tiny_model

# The suite's engines decode eagerly unless a test asks for compiled graphs: by default each engine without saved
# graphs would start a background builder (runtime/executor/graph_builder.py), competing for CI's two cores; set
# before the first scheduler process starts, since engines' processes inherit it. tests/test_graph_cache.py turns
# it on.
os.environ.setdefault("FURCATE_AUTO_COMPILE", "0")

ARCHS = sorted(CONFIGS)
# Engine arguments of every test that compares with HF transformers in float32 (dtype auto would pick bfloat16
# on CPUs with native bf16, and quantization auto the default model's int4 kernels).
EXACT = {"dtype": "float32", "quantization": "none"}
TINY_POOL_TOKENS = 6000
CHECKOUT = Path(__file__).resolve().parents[1]


class CheckoutRootIsNoTestPackage:
    """The repository root has an __init__.py (it is the furcate package), so pytest would collect it as a Package
    and, to look for a setup_module there, import that __init__.py under the checkout folder's name: a second copy
    of furcate beside the installed one. It is collected as a plain directory instead."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path: Path, parent: pytest.Collector) -> pytest.Collector | None:
        return pytest.Dir.from_parent(parent, path=path) if path.resolve() == CHECKOUT else None


def pytest_configure(config: pytest.Config) -> None:
    # A plugin, not a hook of this conftest: a conftest's hooks only see the folders below its own.
    config.pluginmanager.register(CheckoutRootIsNoTestPackage(), "furcate-checkout-root")
    # The suite starts engine after engine: each takes a scheduler process that imported while the last test ran.
    keep_a_spare_scheduler()


# For engines and servers of tests that send no grammar request: building grammar_backend="auto"'s backends costs
# ~2.6 s of every start (tokenizer tables for llguidance and xgrammar), and unconstrained requests never touch them.
NO_GRAMMAR = {"grammar_backend": "none"}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(arch, root / arch, default_model_dir) for arch in ARCHS}


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def assert_pool_free(engine: Engine) -> None:
    """The invariant every test ends with: every KV slot is free or cached unlocked, and a flush frees all."""
    assert engine.check_integrity()
    stats = engine.get_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["protected_tokens"] == 0, stats
    assert stats["kv_available"] + stats["evictable_tokens"] == stats["max_total_tokens"], stats
    assert stats["req_slots_available"] == stats["max_running_requests"], stats
    assert engine.flush_cache()
    assert engine.get_stats()["kv_available"] == stats["max_total_tokens"]


@pytest.fixture(scope="session")
def default_engine():
    """The real default model, shared by every test that needs it (it takes ~15 s to start)."""
    with Engine("default", **EXACT, max_total_tokens=4096, torch_num_threads=2) as engine:
        yield engine


@pytest.fixture(scope="session")
def shared_llama_engine(tiny_model_dirs):
    # A pathlib.Path, as from_pretrained takes one (the other engines get str).
    with Engine(tiny_model_dirs["llama"], **EXACT, max_total_tokens=TINY_POOL_TOKENS,
                torch_num_threads=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def llama_engine(shared_llama_engine):
    """The tiny llama engine, one for the session (each start costs seconds): every module gets it with a cold
    prefix cache, as a fresh engine would be, and nothing in flight. Its statistics are counted since its start,
    so a test reads them as differences."""
    assert shared_llama_engine.flush_cache()
    yield shared_llama_engine
    stats = shared_llama_engine.get_stats()  # the module left nothing running for the next one
    assert stats["running"] == 0 and stats["waiting"] == 0, stats


def start_side_by_side(*engines: tuple[str, dict]) -> list[Engine]:
    """Engines for (model path, engine arguments), started side by side: a start is mostly one core's work
    (imports and loading). If one fails, the others are shut down."""
    with ThreadPoolExecutor(len(engines)) as pool:
        starting = [pool.submit(Engine, path, **args) for path, args in engines]
    failed = next((future.exception() for future in starting if future.exception() is not None), None)
    if failed is not None:
        shut_down([future.result() for future in starting if future.exception() is None])
        raise failed
    return [future.result() for future in starting]


def shut_down(engines: list[Engine]) -> None:
    with ThreadPoolExecutor(len(engines) or 1) as pool:
        list(pool.map(Engine.shutdown, engines))


@contextlib.contextmanager
def engines_side_by_side(*engines: tuple[str, dict]) -> Iterator[list[Engine]]:
    """start_side_by_side's engines, shut down together at the end."""
    started = start_side_by_side(*engines)
    try:
        yield started
    finally:
        shut_down(started)


@contextlib.contextmanager
def engine_starting(model_path: str, **engine_args) -> Iterator[Callable[[], Engine]]:
    """An engine that starts in the background while the test does other work (its HF reference, say); call what
    this yields for the engine once it is needed. Shut down at the end."""
    pool = ThreadPoolExecutor(1)
    starting = pool.submit(Engine, model_path, **engine_args)
    pool.shutdown(wait=False)
    try:
        yield starting.result
    finally:
        if starting.exception() is None:
            starting.result().shutdown()


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """What the test builds once per machine (GGUF conversions, kernel choices, compiled graphs) goes to a
    temporary cache, not the user's. The built kernels stay shared: each is keyed by its source, flags and CPU,
    and building the C++ ops again would cost each engine started here ~15 s."""
    shared = native_build.cache_dir()
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("FURCATE_CACHE", str(tmp_path))


@pytest.fixture
def idle_machine(monkeypatch):
    """Kernel choices measured in this process see an idle machine (kernel_choice.busy_elsewhere), whatever else
    runs here: a test that counts measurements would otherwise count the second timing a busy machine asks for."""
    from furcate.runtime.model import kernel_choice

    monkeypatch.setattr(kernel_choice, "busy_elsewhere", lambda start, end: 0.0)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dirs):
    """A live `furcate serve` on the tiny llama model, on a free loopback port (no API key)."""
    with ServerProcess(str(tiny_model_dirs["llama"]), {"max_total_tokens": TINY_POOL_TOKENS,
                                                       "torch_num_threads": 2, "dtype": "float32"}) as server:
        yield server


T = TypeVar("T")


class Revivable(Generic[T]):
    """A process shared by a module's tests (a server, a cluster) that a test may stop or kill on purpose: `get()`
    gives the running one, or starts a new one when the last was stopped, so no test depends on running before or
    after the one that stops it."""

    def __init__(self, start: Callable[[], T], stop: Callable[[T], object], alive: Callable[[T], bool]) -> None:
        self._start, self._stop, self._alive = start, stop, alive
        self._current: T | None = None

    def get(self) -> T:
        if self._current is not None and not self._alive(self._current):
            self.close()
        if self._current is None:
            self._current = self._start()
        return self._current

    def close(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            self._stop(current)


def assert_server_pool_free(url: str, headers: dict | None = None) -> None:
    """assert_pool_free over HTTP: nothing in flight, the KV bookkeeping intact, a flush frees every slot."""
    info = requests.get(f"{url}/get_server_info", params={"check_integrity": "1"}, headers=headers, timeout=60)
    stats = info.json()["internal_states"][0]
    assert stats["kv_integrity"] is True
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["protected_tokens"] == 0, stats
    assert stats["kv_available"] + stats["evictable_tokens"] == stats["max_total_tokens"], stats
    assert requests.post(f"{url}/flush_cache", headers=headers, timeout=60).json()["success"] is True
    stats = requests.get(f"{url}/get_server_info", headers=headers, timeout=60).json()["internal_states"][0]
    assert stats["kv_available"] == stats["max_total_tokens"], stats


@pytest.fixture
def engine(llama_engine):
    """The tiny llama engine, checked to be fully free after the test."""
    yield llama_engine
    assert_pool_free(llama_engine)


class HFReference:
    """HF transformers on the same weights: the greedy and logprob reference."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, input_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
        ids = torch.tensor([input_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs)
        return out[0, len(input_ids):].tolist()

    @torch.inference_mode()
    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """[len, vocab] log-softmax; row i predicts token i + 1."""
        logits = self.model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dirs):
    cache: dict[str, HFReference] = {}

    def get(arch: str) -> HFReference:
        if arch not in cache:
            cache[arch] = HFReference(tiny_model_dirs[arch])
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def docs_site(tmp_path_factory) -> Path:
    """The docs site, built once with `mkdocs build --strict` (tests/docs_pages.py), for test_docs and the
    browser check; a failed build fails each test that asks for it, with mkdocs' output."""
    from docs_pages import build_site

    folder = tmp_path_factory.mktemp("docs") / "site"
    built = build_site(folder)
    assert built.returncode == 0, built.stdout + built.stderr
    return folder
