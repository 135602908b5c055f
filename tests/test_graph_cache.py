"""Compiled decode graphs saved and loaded (graph_cache.py), built in the background (graph_builder.py), and the
default engine that decodes eagerly until they arrive, then through them, with the same greedy output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import EXACT, NO_GRAMMAR
from furcate import Engine
from furcate.runtime.cache.memory_pool import TokenToKVPool
from furcate.runtime.executor.build_locks import KEY_LOCK, MAX_BUILDERS_ENV, holder, key_lock, max_builders, try_lock
from furcate.runtime.executor.compiled_decode import compile_graphs, decode_step, uses_paged_kernel
from furcate.runtime.executor.graph_builder import BuildSpec, build
from furcate.runtime.executor.graph_cache import complete, graph_dir, graph_file, graph_key, load_graphs, save_graphs
from furcate.runtime.kernels import paged_attention
from furcate.runtime.model.weights.loader import load_model

# Kernel choices fixed, not measured: a choice measured while other tests keep the CPUs busy is provisional, and the
# next idle start measures it again (tests/test_kernel_choice.py), which may change the graph key these tests follow.
FIXED_KERNELS = {"packed_linear": "off", "dense_gemv": "off"}
BUILD_WAIT_S = 600  # a cold build of the tiny model is ~30 s on 2 cores; CI's machines may be slower
BUILDER = "furcate.runtime.executor.graph_builder"
HOLD_A_LOCK = """
import pathlib, sys, time
from furcate.runtime.executor.build_locks import try_lock
assert try_lock(pathlib.Path(sys.argv[1])) is not None
print("held", flush=True)
time.sleep(600)
"""


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


def test_a_lock_is_held_once_and_freed_when_its_holder_exits_however_it_exits(tmp_path):
    lock = tmp_path / "key" / KEY_LOCK
    fd = try_lock(lock)
    assert fd is not None and holder(lock) == str(os.getpid())
    assert try_lock(lock) is None  # another open file of the same process counts as another holder
    os.close(fd)
    again = try_lock(lock)
    assert again is not None
    os.close(again)
    taker = subprocess.Popen([sys.executable, "-c", HOLD_A_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert taker.stdout.readline() == "held\n"
        assert try_lock(lock) is None and holder(lock) == str(taker.pid)
    finally:
        taker.kill()
        taker.wait()
    fd = try_lock(lock)  # killed: no stale lock to judge
    assert fd is not None
    os.close(fd)


@pytest.mark.parametrize("text", ["0", "-1", "two", "", "1.5"])
def test_a_bad_builder_cap_is_a_clear_error(monkeypatch, text):
    monkeypatch.setenv(MAX_BUILDERS_ENV, text)
    with pytest.raises(ValueError, match="FURCATE_MAX_BUILDERS must be an integer >= 1"):
        max_builders()


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
    args = {**EXACT, **NO_GRAMMAR, **FIXED_KERNELS, "torch_compile_max_bs": 1, "max_total_tokens": 600,
            "torch_num_threads": 2}
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
    assert len(folders) == 1 and complete(folders[0], [1]) and lock_free(folders[0])
    with Engine(str(tiny_model_dirs["llama"]), **args) as engine:
        assert engine.generate(input_ids=ids, sampling_params=params)["output_ids"] == expected
        assert engine.get_stats()["compiled_forward_calls"] == 9  # every token after the prefill's
        assert engine.get_stats()["decode_graphs"] == "compiled"
    assert len(list((tmp_path / "graphs").iterdir())) == 1


def test_a_build_that_fails_is_not_tried_again_at_every_start(tiny_model_dirs, tmp_path, private_cache):
    """No C++ compiler for inductor: the builder fails, says why, and later starts stay eager without a builder."""
    from furcate.runtime.executor.graph_builder import FAILED, start_background_build

    spec = tiny_spec(tiny_model_dirs)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    run = subprocess.run([sys.executable, "-m", "furcate.runtime.executor.graph_builder", spec.to_json()], env=env,
                         capture_output=True, text=True, timeout=BUILD_WAIT_S)
    assert run.returncode != 0
    failed = graph_dir(spec.key) / FAILED
    assert failed.exists() and "no-such-compiler" in failed.read_text()
    assert not complete(graph_dir(spec.key), [1]) and lock_free(graph_dir(spec.key))
    assert start_background_build(spec) is None


def lock_free(folder) -> bool:
    """Whether no process holds the build lock of the graphs in folder."""
    fd = try_lock(key_lock(folder))
    if fd is not None:
        os.close(fd)
    return fd is not None


def builders_of(cache) -> list[int]:
    """The live graph builders that work for this cache folder (by their command line and environment)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if BUILDER.encode() in (proc / "cmdline").read_bytes() and \
                    f"FURCATE_CACHE={cache}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie nor gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, seconds: float = BUILD_WAIT_S) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.2)
    return predicate()


def paused_builders(cache, count: int) -> list[int]:
    """The builders, once `count` run, stopped (SIGSTOP) so that none finishes while the test looks."""
    assert wait_for(lambda: len(builders_of(cache)) >= count, 120)
    pids = builders_of(cache)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def tiny_engines(path, max_bs: list[int]) -> list[Engine]:
    """Engines over the tiny model started at once (one thread each), one per torch_compile_max_bs (1 and 2:
    two graph keys)."""
    args = {**EXACT, **NO_GRAMMAR, **FIXED_KERNELS, "max_total_tokens": 600, "torch_num_threads": 1}
    with ThreadPoolExecutor(len(max_bs)) as pool:
        return list(pool.map(lambda bs: Engine(path, torch_compile_max_bs=bs, **args), max_bs))


@pytest.mark.parametrize("max_bs, cap, at_once", [([1, 1], "2", 1), ([1, 2], "1", 1), ([1, 2], "2", 2)],
                         ids=["same-key", "capped", "two-keys-two-slots"])
def test_builders_one_per_key_at_most_the_cap_and_none_outlives_its_engine(
        tiny_model_dirs, tmp_path, private_cache, monkeypatch, max_bs, cap, at_once):
    """Two engines start at once: one builder per key, never more than FURCATE_MAX_BUILDERS; when the engine that
    started a builder shuts down the builder goes with it, and the engine that waited starts its own."""
    monkeypatch.setenv("FURCATE_AUTO_COMPILE", "1")
    monkeypatch.setenv(MAX_BUILDERS_ENV, cap)
    engines = tiny_engines(str(tiny_model_dirs["llama"]), max_bs)
    try:
        pids = paused_builders(tmp_path, at_once)
        parents = [parent_of(pid) for pid in pids]
        assert not wait_for(lambda: len(builders_of(tmp_path)) > at_once, 6)  # 3 polls of the waiting engine
        assert all(engine.get_stats()["decode_graphs"] == "building" for engine in engines)
        starter = next(e for e in engines if e._process.pid == parents[0])
        starter.shutdown()
        assert not alive(pids[0])  # shut down: its builder went before the engine's process did
        waiting = [e for e in engines if e._process.pid not in parents]
        if waiting:  # it takes over: the same key's build, or the slot
            assert wait_for(lambda: any(parent_of(pid) == waiting[0]._process.pid for pid in builders_of(tmp_path)))
    finally:
        for engine in engines:
            engine.shutdown()
    assert builders_of(tmp_path) == []


def test_a_builder_goes_when_its_engine_is_killed(tiny_model_dirs, tmp_path, private_cache, monkeypatch):
    monkeypatch.setenv("FURCATE_AUTO_COMPILE", "1")
    [engine] = tiny_engines(str(tiny_model_dirs["llama"]), [1])
    try:
        [pid] = paused_builders(tmp_path, 1)  # stopped: only the kernel can end it (a polling thread could not)
        os.kill(engine._process.pid, signal.SIGKILL)
        assert wait_for(lambda: not alive(pid), 30)
    finally:
        engine.shutdown()


def tiny_spec(tiny_model_dirs, sizes: tuple[int, ...] = (1,)) -> BuildSpec:
    """What an engine over the tiny llama model (float32, eager kernels as the builder loads them) hands its
    builder."""
    from furcate.runtime.executor.serving_model import load_serving_model

    model, _ = load_serving_model(str(tiny_model_dirs["llama"]), torch.float32, "none", graphs=True)
    attn = model.model.layers[0].self_attn
    pool = TokenToKVPool(16, len(model.model.layers), attn.num_kv_heads, attn.head_dim, torch.float32, "cpu")
    return BuildSpec(str(tiny_model_dirs["llama"]), "float32", "none", 0,
                     (len(model.model.layers), attn.num_kv_heads, attn.head_dim), sizes, torch.get_num_threads(),
                     graph_key(model, pool, list(sizes)))


def test_a_builder_that_makes_no_progress_is_stopped(tiny_model_dirs, tmp_path, private_cache, monkeypatch):
    """A builder that gets no CPU (here: stopped; on a busy machine: SCHED_IDLE) is killed after STALL_S."""
    from furcate.runtime.executor import graph_builder

    monkeypatch.setattr(graph_builder, "STALL_S", 2.0)
    monkeypatch.setattr(graph_builder, "POLL_S", 0.2)
    watch = graph_builder.BackgroundGraphs(tiny_spec(tiny_model_dirs))
    try:
        [pid] = paused_builders(tmp_path, 1)
        watch.thread.join(60)
        assert not watch.thread.is_alive() and not alive(pid)
        assert watch.graphs is None and not watch.pending()
    finally:
        watch.stop()
    assert lock_free(graph_dir(watch.spec.key))


def test_prepare_builds_the_graphs_and_waits_and_the_next_engine_loads_them(
        tiny_model_dirs, tmp_path, private_cache, monkeypatch):
    """`furcate prepare` with an engine's options compiles that engine's graphs at normal priority and returns
    once they are saved (each graph's progress shown); an engine started with the same options loads them. With
    --remeasure it first forgets the kept kernel choices."""
    forgotten = tmp_path / "kernel_choice" / "0123.json"
    forgotten.parent.mkdir()
    forgotten.write_text('{"value": 0}')
    options = ["--model-path", str(tiny_model_dirs["llama"]), "--dtype", "float32", "--quantization", "none",
               "--torch-compile-max-bs", "2", "--torch-num-threads", "2", "--max-total-tokens", "600",
               "--grammar-backend", "none", "--packed-linear", "off", "--dense-gemv", "off"]
    run = subprocess.run([sys.executable, "-m", "furcate.cli", "prepare", "--remeasure", *options],
                         capture_output=True, text=True, timeout=BUILD_WAIT_S)
    assert run.returncode == 0, run.stderr
    assert "decode graphs: compiled" in run.stdout and "forgot 1 kept kernel choice" in run.stdout
    assert "decode graph 2 of 2" in run.stderr and not forgotten.exists()
    assert builders_of(tmp_path) == []
    monkeypatch.setenv("FURCATE_AUTO_COMPILE", "1")
    args = {**EXACT, **NO_GRAMMAR, **FIXED_KERNELS, "torch_compile_max_bs": 2, "torch_num_threads": 2,
            "max_total_tokens": 600}
    with Engine(str(tiny_model_dirs["llama"]), **args) as engine:
        assert engine.get_stats()["decode_graphs"] == "compiled"
    assert builders_of(tmp_path) == []
