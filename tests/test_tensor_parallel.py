"""Tensor parallelism: tp_size=2 (two processes over gloo on loopback) gives tp_size=1's greedy outputs and,
within float rounding of the split matmuls, its logprobs; processes never outlive the engine."""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ARCHS, EXACT, assert_pool_free
from furcate import Engine
from furcate.cli import build_parser
from furcate.runtime.config import EngineArgs
from furcate.runtime.distributed.parallel_state import TensorParallel
from furcate.runtime.distributed.spawn import spawn_followers
from furcate.runtime.distributed.tp_layers import shard_tensor
from furcate.runtime.model.weights.loader import load_model
from processes import descendants, wait_gone

# No grammar backend: grammars only touch rank 0's sampling, and building one costs seconds per engine start.
ENGINE_ARGS = {**EXACT, "max_total_tokens": 3000, "chunked_prefill_size": 16, "torch_num_threads": 1,
               "grammar_backend": "none"}
# Prompts shorter than, and several times, the chunk size (chunked prefill), half of them behind a shared prefix
# (radix cache hits once the first request cached it).
PREFIX = "a long shared preamble about rivers and stones and the quiet old machines that sang over the hills, "
PROMPTS = [PREFIX + "first", PREFIX + "and then 42", PREFIX + "light " * 9, "the", "old machines sang; 3.14 never",
           "river of stone " * 12]
PARAMS = [{"max_new_tokens": 3 + 2 * i, "temperature": 0, "ignore_eos": True} for i in range(len(PROMPTS))]
LOGPROB_TOLERANCE = 1e-4  # the ranks' partial sums round differently; measured up to 8e-6


def run_workload(engine: Engine) -> dict[str, list[dict]]:
    """The prefix cached by one request, then a batch that hits it; then the batch with prompt and output logprobs
    (prompt logprobs from position 0 recompute the prefix: no cache hits there)."""
    engine.generate(PREFIX + "warm", {"max_new_tokens": 1, "temperature": 0})
    return {"greedy": engine.generate(PROMPTS, PARAMS),
            "logprobs": engine.generate(PROMPTS, PARAMS, return_logprob=True, logprob_start_len=0)}


def assert_same_outputs(got: dict[str, list[dict]], expected: dict[str, list[dict]]) -> None:
    for run in ("greedy", "logprobs"):
        assert [r["output_ids"] for r in got[run]] == [r["output_ids"] for r in expected[run]], run
    # The shared prefix came from the cache (so table rows written by a prefix match reached the follower).
    cached = [r["meta_info"]["cached_tokens"] for r in got["greedy"]]
    assert cached == [r["meta_info"]["cached_tokens"] for r in expected["greedy"]]
    assert all(n > 10 for n in cached[:3]), cached
    for mine, theirs in zip(got["logprobs"], expected["logprobs"]):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            a = [entry[0] for entry in mine["meta_info"][key] if entry[0] is not None]
            b = [entry[0] for entry in theirs["meta_info"][key] if entry[0] is not None]
            assert len(a) == len(b) and a == pytest.approx(b, abs=LOGPROB_TOLERANCE), key
            assert len(a) >= len(mine["meta_info"][key]) - 1  # only the first prompt token has no logprob


def processes_of(engine: Engine) -> set[int]:
    """The scheduler process (rank 0) and everything it started."""
    return {engine._process.pid} | descendants(engine._process.pid)


def assert_all_gone(pids: set[int], timeout: float = 20) -> None:
    alive = wait_gone(pids, timeout)
    assert not alive, f"processes left behind: {alive}"


@pytest.fixture(scope="module")
def tp1_outputs(tiny_model_dirs):
    """The tp_size=1 reference per architecture, each from one engine that is shut down at once (2 cores)."""
    cache: dict[str, dict[str, list[dict]]] = {}

    def get(arch: str) -> dict[str, list[dict]]:
        if arch not in cache:
            with Engine(str(tiny_model_dirs[arch]), **ENGINE_ARGS) as engine:
                cache[arch] = run_workload(engine)
        return cache[arch]

    return get


def test_tp_size_is_checked_before_any_process_starts(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="tp_size must be in"):
        EngineArgs(tp_size=9)
    with pytest.raises(ValueError, match="quantization='gguf' does not support tp_size > 1"):
        EngineArgs(tp_size=2, quantization="gguf")
    path = str(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match=r"must divide the model's num_attention_heads \(4\)"):
        Engine(path, **ENGINE_ARGS, tp_size=3)
    with pytest.raises(ValueError, match=r"must divide the model's num_key_value_heads \(2\)"):
        Engine(path, **ENGINE_ARGS, tp_size=4)
    config = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 130, "num_key_value_heads": 4}))
    with pytest.raises(ValueError, match=r"must divide the model's intermediate_size \(130\)"):
        Engine(str(tmp_path), **ENGINE_ARGS, tp_size=4)
    assert build_parser().parse_args(["serve", "--tp-size", "2"]).tp_size == 2


def test_each_rank_loads_only_its_shard(tiny_model_dirs):
    """Rank 1 of 2 on qwen2 (q/k/v biases, tied embeddings), built without a process group: its parameters are its
    slices of the full model's, q/k/v and gate/up each cut on its own inside the fused weights."""
    full = load_model(str(tiny_model_dirs["qwen2"]), torch.float32)
    shard = load_model(str(tiny_model_dirs["qwen2"]), torch.float32, tp=TensorParallel(rank=1, size=2))
    attn, full_attn = shard.model.layers[0].self_attn, full.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)

    def second_halves(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.cat([part.chunk(2)[1] for part in tensor.split(sizes)])

    qkv_sizes = [full_attn.q_size, full_attn.kv_size, full_attn.kv_size]
    assert torch.equal(attn.qkv_proj.weight, second_halves(full_attn.qkv_proj.weight, qkv_sizes))
    assert torch.equal(attn.qkv_proj.bias, second_halves(full_attn.qkv_proj.bias, qkv_sizes))
    assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight.chunk(2, dim=1)[1])
    mlp, full_mlp = shard.model.layers[0].mlp, full.model.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight, second_halves(full_mlp.gate_up_proj.weight, [128, 128]))
    assert torch.equal(mlp.down_proj.weight, full_mlp.down_proj.weight.chunk(2, dim=1)[1])
    assert torch.equal(shard.model.embed_tokens.weight, full.model.embed_tokens.weight.chunk(2)[1])
    assert shard.lm_head.weight is shard.model.embed_tokens.weight
    # A vocabulary that does not split evenly: the last rank's range is padded with zero rows.
    padded = shard_tensor("lm_head.weight", torch.arange(1.0, 11.0).view(5, 2), TensorParallel(rank=1, size=2))
    assert padded.tolist() == [[7.0, 8.0], [9.0, 10.0], [0.0, 0.0]]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_and_logprobs_equal_tp1(arch, tiny_model_dirs, tp1_outputs):
    # The tp_size=2 engine starts (two processes importing and loading) while the reference runs on tp_size=1.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(Engine, str(tiny_model_dirs[arch]), **ENGINE_ARGS, tp_size=2)
        try:
            expected = tp1_outputs(arch)
        except BaseException:
            if starting.exception() is None:
                starting.result().shutdown()
            raise
    with starting.result() as engine:
        assert engine.info.tp_size == 2
        processes = processes_of(engine)
        assert len(processes) == 2  # the scheduler and its one follower
        got = run_workload(engine)
        assert_pool_free(engine)
    assert_same_outputs(got, expected)
    assert_all_gone(processes, timeout=0)  # shutdown() returned only after every rank stopped


def test_overlap_loop_then_a_killed_engine_process_leaves_nothing(tiny_model_dirs, tp1_outputs):
    """An engine process (overlap loop on) that runs the workload and is then killed: its scheduler sees the engine
    gone and stops its follower on the way out."""
    engine_args = {**ENGINE_ARGS, "tp_size": 2, "disable_overlap_schedule": False}
    script = "\n".join([
        "import json, time",
        "from furcate import Engine",
        f"PREFIX, PROMPTS, PARAMS = {PREFIX!r}, {PROMPTS!r}, {PARAMS!r}",
        inspect.getsource(run_workload),
        f"engine = Engine({str(tiny_model_dirs['llama'])!r}, **{engine_args!r})",
        "print(json.dumps(run_workload(engine)), flush=True)",
        "time.sleep(600)",
    ])
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        processes = descendants(holder.pid)
        assert len(processes) == 2, processes  # scheduler and follower
        assert_same_outputs(json.loads(line), tp1_outputs("llama"))
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert_all_gone(processes)
    finally:
        holder.kill()
        holder.wait()


def test_follower_exits_when_its_rank_zero_goes_away():
    """Rank 0 killed outright sends no stop message: the closed pipe alone must end the follower."""
    spawned = spawn_followers(1)
    spawned.pipes[0].close()
    assert spawned.processes[0].wait(timeout=60) == 0


# Loaded by every interpreter started with PYTHONPATH pointing here; breaks only the follower's model loading.
BROKEN_FOLLOWER = """
import sys
if "furcate.runtime.executor.tp_follower" in sys.orig_argv:
    from furcate.runtime.model.weights import loader

    def load_model(*args, **kwargs):
        raise OSError("injected: this rank cannot read its shard")

    loader.load_model = load_model
"""


def test_follower_start_up_error_is_a_clear_engine_error(tiny_model_dirs, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(BROKEN_FOLLOWER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    before = descendants(os.getpid())
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)tensor-parallel rank 1 failed to start.*injected: this rank"):
        Engine(str(tiny_model_dirs["llama"]), **ENGINE_ARGS, tp_size=2)
    assert time.monotonic() - started < 60
    assert_all_gone(descendants(os.getpid()) - before)
