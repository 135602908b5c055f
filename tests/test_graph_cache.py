"""Compiled decode graphs saved and loaded (graph_cache.py), built in the background (graph_builder.py), and the
default engine that decodes eagerly until they arrive, then through them, with the same greedy output."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import EXACT, NO_GRAMMAR
from furcate import Engine
from furcate.runtime.cache.memory_pool import TokenToKVPool
from furcate.runtime.executor.compiled_decode import compile_graphs, decode_step, uses_paged_kernel
from furcate.runtime.executor.graph_builder import LOCK, BuildSpec, build, build_lock
from furcate.runtime.executor.graph_cache import complete, graph_dir, graph_file, graph_key, load_graphs, save_graphs
from furcate.runtime.kernels import paged_attention
from furcate.runtime.model.weights.loader import load_model

BUILD_WAIT_S = 600  # a cold build of the tiny model is ~30 s on 2 cores; CI's machines may be slower


def tiny(tiny_model_dirs, dtype=torch.float32, pool_tokens: int = 64):
    model = load_model(str(tiny_model_dirs["llama"]), dtype, "cpu")
    attn = model.model.layers[0].self_attn
    pool = TokenToKVPool(pool_tokens, len(model.model.layers), attn.num_kv_heads, attn.head_dim, dtype, "cpu")
    return model, pool


def decode_inputs(model, bs: int, length: int, pool: TokenToKVPool) -> tuple:
    torch.manual_seed(bs)
    for buffer in (*pool.k_buffer, *pool.v_buffer):
        buffer.normal_()
    kv_index = torch.arange(1, bs * length + 1).view(bs, length)
    paged = uses_paged_kernel(model, pool.dtype)
    key_valid = None if bs == 1 or paged else torch.ones(bs, 1, 1, length, dtype=torch.bool)
    ids, positions = torch.arange(100, 100 + bs), torch.full((bs,), length - 1)
    slots = kv_index[:, -1] + 0  # each request's newest token: its own KV slot
    spans = paged_attention.spans(torch.arange(bs), torch.ones(bs, dtype=torch.long), torch.full((bs,), length - 1))
    return ids, positions, slots, kv_index, spans, key_valid, pool.k_buffer, pool.v_buffer


def test_saved_graphs_load_and_compute_what_eager_decode_does(tiny_model_dirs, private_cache):
    model, pool = tiny(tiny_model_dirs)
    sizes = [1, 2]
    folder = graph_dir(graph_key(model, pool, sizes))
    save_graphs(folder, compile_graphs(model, pool, sizes))
    assert complete(folder, sizes)
    loaded = load_graphs(folder, sizes)
    with torch.inference_mode():
        for bs in (1, 2, 3):
            inputs = decode_inputs(model, bs, 5, pool)
            eager = decode_step(model, *inputs)
            graph = loaded[1 if bs == 1 else 2]
            torch.testing.assert_close(graph(model, *inputs), eager, rtol=1e-4, atol=1e-4)


def test_the_key_follows_what_a_graph_bakes_in(tiny_model_dirs):
    model, pool = tiny(tiny_model_dirs)
    key = graph_key(model, pool, [1, 2])
    again, other_pool = tiny(tiny_model_dirs, pool_tokens=500)
    assert graph_key(again, other_pool, [1, 2]) == key  # new weights and a pool of another size: the same graphs
    assert graph_key(model, pool, [1]) != key
    assert graph_key(*tiny(tiny_model_dirs, torch.bfloat16), [1, 2]) != key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert graph_key(model, pool, [1, 2]) != key
    finally:
        torch.set_num_threads(threads)
    model.model.norm.eps *= 2  # a constant the graph holds
    assert graph_key(model, pool, [1, 2]) != key


def test_graph_folders_long_unused_are_pruned_and_loading_keeps_one(tmp_path):
    from furcate.runtime.executor.graph_cache import UNUSED_S, prune_unused

    now = time.time()
    old, recent, loaded = (tmp_path / name for name in ("old", "recent", "loaded"))
    for folder in (old, recent, loaded):
        folder.mkdir()
        os.utime(folder, (now - 2 * UNUSED_S, now - 2 * UNUSED_S))
    os.utime(recent, (now - UNUSED_S / 2, now - UNUSED_S / 2))
    graph_file(loaded, 1).write_bytes(b"")
    os.utime(loaded, (now - 2 * UNUSED_S, now - 2 * UNUSED_S))
    assert load_graphs(loaded, []) == {}  # no sizes asked: nothing read, but the folder counts as used
    assert prune_unused(tmp_path, now) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loaded", "recent"]


@pytest.mark.parametrize("content", [b"", b"\x80not a pickle", b"x" * 1000])
def test_a_damaged_graph_file_is_removed_not_loaded(tmp_path, content):
    folder = tmp_path / "graphs"
    folder.mkdir()
    graph_file(folder, 1).write_bytes(content)
    assert load_graphs(folder, [1]) is None
    assert not folder.exists()


def test_one_builder_holds_the_lock_and_a_dead_ones_is_taken_over(tmp_path):
    with build_lock(tmp_path) as first:
        assert first and (tmp_path / LOCK).read_text() == str(os.getpid())
        with build_lock(tmp_path) as second:
            assert not second
    assert not (tmp_path / LOCK).exists()
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    for stale in (finished.stdout.strip(), "garbage", ""):
        (tmp_path / LOCK).write_text(stale)
        with build_lock(tmp_path) as mine:
            assert mine
        assert not (tmp_path / LOCK).exists()


def test_the_builder_refuses_a_model_other_than_the_engines(tiny_model_dirs, private_cache):
    spec = BuildSpec(str(tiny_model_dirs["llama"]), "float32", "none", 0, (2, 2, 16), (1,),
                     torch.get_num_threads(), "0" * 24)
    assert BuildSpec.from_json(spec.to_json()) == spec
    assert build(spec) == 2
    assert not complete(graph_dir(spec.key), [1])


def test_a_default_engine_builds_its_graphs_in_the_background_then_loads_them(
        tiny_model_dirs, hf_reference, tokenizer, tmp_path, private_cache, monkeypatch):
    """enable_torch_compile unset: the first start decodes eagerly while a builder compiles the graph, switches
    to it when it is saved, and the next start loads it; HF's greedy tokens all along (float32)."""
    monkeypatch.setenv("FURCATE_AUTO_COMPILE", "1")  # private_cache: FURCATE_CACHE is tmp_path
    ids = tokenizer.encode("a lantern hung above the quiet harbour")
    params = {"max_new_tokens": 10, "temperature": 0.0}
    expected = hf_reference("llama").greedy(ids, 10)
    args = {**EXACT, **NO_GRAMMAR, "torch_compile_max_bs": 1, "max_total_tokens": 600, "torch_num_threads": 2}
    with Engine(str(tiny_model_dirs["llama"]), **args) as engine:
        assert engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == expected
        assert engine.get_stats()["compiled_forward_calls"] == 0  # the builder has not even imported torch yet
        assert engine.get_stats()["decode_graphs"] == "building"
        deadline = time.monotonic() + BUILD_WAIT_S
        while engine.get_stats()["compiled_forward_calls"] == 0 and time.monotonic() < deadline:
            time.sleep(1)
            assert engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == expected
        assert engine.get_stats()["compiled_forward_calls"] > 0
        assert engine.get_stats()["decode_graphs"] == "compiled"
    folders = list((tmp_path / "graphs").iterdir())
    assert len(folders) == 1 and complete(folders[0], [1]) and not (folders[0] / LOCK).exists()
    with Engine(str(tiny_model_dirs["llama"]), **args) as engine:
        assert engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == expected
        assert engine.get_stats()["compiled_forward_calls"] == 9  # every token after the prefill's
        assert engine.get_stats()["decode_graphs"] == "compiled"
    assert len(list((tmp_path / "graphs").iterdir())) == 1


def test_a_build_that_fails_is_not_tried_again_at_every_start(tiny_model_dirs, tmp_path, private_cache):
    """No C++ compiler for inductor: the builder fails, says why, and later starts stay eager without a builder."""
    from furcate.runtime.executor.graph_builder import FAILED, start_background_build
    from furcate.runtime.executor.serving_model import load_serving_model

    model, _ = load_serving_model(str(tiny_model_dirs["llama"]), torch.float32, "none", graphs=True)
    attn = model.model.layers[0].self_attn
    pool = TokenToKVPool(16, len(model.model.layers), attn.num_kv_heads, attn.head_dim, torch.float32, "cpu")
    spec = BuildSpec(str(tiny_model_dirs["llama"]), "float32", "none", 0,
                     (len(model.model.layers), attn.num_kv_heads, attn.head_dim), (1,), torch.get_num_threads(),
                     graph_key(model, pool, [1]))
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    run = subprocess.run([sys.executable, "-m", "furcate.runtime.executor.graph_builder", spec.to_json()], env=env,
                         capture_output=True, text=True, timeout=BUILD_WAIT_S)
    assert run.returncode != 0
    failed = graph_dir(spec.key) / FAILED
    assert failed.exists() and "no-such-compiler" in failed.read_text()
    assert not complete(graph_dir(spec.key), [1]) and not (graph_dir(spec.key) / LOCK).exists()
    assert start_background_build(spec) is None
