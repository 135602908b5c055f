"""RL rollout serving: weight updates (tensor, disk, distributed from a trainer process, tp_size 2), the prefix
cache never serving K/V of old weights, refused updates leaving the old weights, pause modes, memory release and
resume (resident memory measured), and the HTTP routes with SGLang's bodies."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from conftest import EXACT, HFReference, assert_pool_free, engines_side_by_side
from furcate import Engine
from furcate.runtime.engine.rl import serialize_named_tensors
from furcate.runtime.server.server_process import ServerProcess
from processes import free_port
from rl_trainer import round_weights

PROMPT = list(range(300, 340))
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
BIG_POOL = 65536  # 33 MB of float32 K/V on the tiny llama: a drop in resident memory that is easy to see


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    """One tiny llama engine to update, one with tp_size 2, one on the overlap loop (started side by side)."""
    path = str(tiny_model_dirs["llama"])
    with engines_side_by_side((path, {**EXACT, "max_total_tokens": BIG_POOL, "torch_num_threads": 1}),
                              (path, {**EXACT, "max_total_tokens": 2048, "tp_size": 2, "torch_num_threads": 1}),
                              (path, {**EXACT, "max_total_tokens": 2048, "torch_num_threads": 1,
                                      "disable_overlap_schedule": False})) as started:
        yield started


@pytest.fixture
def engine(engines, tiny_model_dirs):
    """The tp_size 1 engine, on the checkpoint's own weights when the test starts."""
    engine = engines[0]
    assert engine.update_weights_from_disk(str(tiny_model_dirs["llama"]), weight_version="checkpoint")[0]
    yield engine
    assert_pool_free(engine)


def model_with(model_dir: Path, weights: dict[str, torch.Tensor]) -> HFReference:
    reference = HFReference(model_dir)
    reference.model.load_state_dict(weights)
    return reference


def submit_running(pool: ThreadPoolExecutor, engine: Engine, max_new_tokens: int):
    """A long greedy request, once the scheduler runs it (or it already ended: nothing waits forever)."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    running = pool.submit(engine.generate, input_ids=PROMPT, sampling_params=sampling)
    deadline = time.monotonic() + 60
    while engine.get_stats()["running"] == 0 and not running.done():
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)
    return running


def greedy(engine: Engine, prompt: list[int] = PROMPT) -> dict:
    return engine.generate(input_ids=prompt, sampling_params=GREEDY)


def test_update_from_tensor_equals_hf_with_the_new_weights_even_for_a_prefix_cached_before(
        engine, tiny_model_dirs, hf_reference):
    model_dir = tiny_model_dirs["llama"]
    before = greedy(engine)
    assert before["output_ids"] == hf_reference("llama").greedy(PROMPT, 8)
    assert before["meta_info"]["weight_version"] == "checkpoint"
    new = round_weights(model_dir, 1)
    success, message = engine.update_weights_from_tensor(list(new.items()), weight_version="round-1")
    assert success, message
    after = greedy(engine)  # the prompt's K/V were cached under the old weights
    assert after["meta_info"]["cached_tokens"] == 0, "K/V of the old weights was served"
    assert after["output_ids"] == model_with(model_dir, new).greedy(PROMPT, 8)
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == engine.get_weight_version() == "round-1"
    rows = engine.get_weights_by_name("model.layers.1.mlp.up_proj.weight", truncate_size=2)
    assert torch.equal(torch.tensor(rows), new["model.layers.1.mlp.up_proj.weight"][:2])


def test_update_from_disk_and_a_running_request_across_an_update(engine, tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["llama"]
    new = round_weights(model_dir, 2)
    saved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    saved.load_state_dict(new)
    saved.save_pretrained(tmp_path / "round2")
    # A request decoding while the weights change: it finishes (its own K/V kept), and nothing it cached is
    # matched by the prompt after the update.
    with ThreadPoolExecutor(1) as pool:
        running = submit_running(pool, engine, 200)
        success, message = engine.update_weights_from_disk(str(tmp_path / "round2"), weight_version="round-2")
        assert success, message
        assert len(running.result()["output_ids"]) == 200
    after = greedy(engine)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["output_ids"] == model_with(model_dir, new).greedy(PROMPT, 8)


def test_every_family_updates_exactly(tiny_model_dirs):
    """Qwen2 (QKV bias, tied head), Qwen3 (q/k norms, tied) and Mistral (sliding window): each equals HF with
    its new weights."""
    archs = ("qwen2", "qwen3", "mistral")
    args = {**EXACT, "max_total_tokens": 1024, "torch_num_threads": 1}
    with engines_side_by_side(*((str(tiny_model_dirs[arch]), args) for arch in archs)) as started:
        for arch, engine in zip(archs, started):
            new = round_weights(tiny_model_dirs[arch], 3)
            success, message = engine.update_weights_from_tensor(list(new.items()))
            assert success, message
            expected = model_with(tiny_model_dirs[arch], new).greedy(PROMPT, 8)
            assert greedy(engine)["output_ids"] == expected, arch


@pytest.mark.parametrize("bad, why", [
    ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))], "shape"),
    ([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))], "no place"),
    ([("model.norm.weight", torch.full((64,), float("nan")))], "NaN"),
    ([("model.norm.weight", torch.ones(64, dtype=torch.int64))], "dtype"),
    ([("model.norm.weight", torch.tensor(1.0))], "scalar"),
    ({"model.norm.weight": "not a tensor"}, "torch.Tensor"),
    ([], "non-empty"),
    ([("", torch.ones(64))], "name"),
])
def test_a_bad_update_is_refused_before_anything_is_written(engine, bad, why):
    before = greedy(engine)["output_ids"]
    good = ("model.norm.weight", torch.full((64,), 3.0))  # would change outputs if it were written
    try:
        success, message = engine.update_weights_from_tensor([good, *bad] if isinstance(bad, list) and bad else bad)
    except ValueError as error:  # refused in the caller, before the call leaves it
        success, message = False, str(error)
    assert not success and why in message, message
    assert engine.get_weight_version() == "checkpoint"
    assert greedy(engine)["output_ids"] == before


def test_bad_disk_updates_and_fields(engine, tiny_model_dirs, tmp_path):
    before = greedy(engine)["output_ids"]
    partial = tmp_path / "partial"
    saved = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    state = {k: v for k, v in saved.state_dict().items() if "layers.1.self_attn.v_proj" not in k}
    saved.save_pretrained(partial, state_dict=state)
    for path, why in ((tmp_path / "missing", "not a directory"), (partial, "lacks tensors")):
        success, message = engine.update_weights_from_disk(str(path))
        assert not success and why in message, message
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x10\x00garbage")
    assert not engine.update_weights_from_disk(str(tmp_path / "corrupt"))[0]
    for call in (lambda: engine.update_weights_from_disk(7), lambda: engine.update_weights_from_disk("x", "gguf"),
                 lambda: engine.update_weights_from_tensor([("a", torch.ones(1))], flush_cache="yes"),
                 lambda: engine.update_weights_from_tensor([("a", torch.ones(1))], weight_version="\ud800"),
                 lambda: engine.update_weights_from_distributed(["a"], ["float32"], [[float("nan")]]),
                 lambda: engine.get_weights_by_name("model.norm.weight", truncate_size=-1),
                 lambda: engine.release_memory_occupation(tags={"weights": 1}),
                 lambda: engine.pause_generation("sometimes"),
                 lambda: engine.init_weights_update_group("127.0.0.1", 70000, 1, 2)):
        with pytest.raises(ValueError):
            call()
    assert not engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]],
                                                      group_name="none")[0]
    assert greedy(engine)["output_ids"] == before and engine.is_alive()


def test_pause_abort_returns_partial_output_and_requests_queue_until_continue(engine):
    with ThreadPoolExecutor(2) as pool:
        running = submit_running(pool, engine, 400)
        assert engine.pause_generation("abort")[0]
        aborted = running.result(timeout=30)
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(aborted["output_ids"]) < 400
        queued = pool.submit(greedy, engine)
        time.sleep(0.3)
        assert not queued.done(), "a request ran while generation was paused"
        assert engine.flush_cache(), "a flush after an abort pause must not fail"
        assert engine.continue_generation()[0]
        assert len(queued.result(timeout=60)["output_ids"]) == 8


def test_pause_retract_frees_kv_and_in_place_refuses_a_flush(engine):
    expected = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 60})["output_ids"]
    assert engine.flush_cache()
    for mode in ("retract", "in_place"):
        with ThreadPoolExecutor(1) as pool:
            running = submit_running(pool, engine, 60)
            assert engine.pause_generation(mode)[0]
            stats = engine.get_stats()
            success, message = engine.flush_cache_result()
            if mode == "retract":
                assert stats["running"] == 0 and stats["protected_tokens"] == 0 and success, (stats, message)
            else:
                assert stats["running"] == 1 and not success and "in place" in message, message
            assert engine.continue_generation()[0]
            assert running.result(timeout=60)["output_ids"] == expected


def rss_bytes(engine: Engine) -> int:
    for line in Path(f"/proc/{engine._process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_release_and_resume_give_memory_back_and_serve_the_same(engine):
    before = greedy(engine)["output_ids"]
    kv_bytes = 2 * 2 * (BIG_POOL + 1) * 2 * 16 * 4  # k and v, 2 layers, 2 KV heads of 16, float32
    weight_bytes = checkpoint_bytes(engine.model_path)
    with ThreadPoolExecutor(1) as pool:  # refused while a request holds K/V
        running = submit_running(pool, engine, 300)
        success, message = engine.release_memory_occupation()
        assert not success and "pause_generation" in message
        running.result()
    resident = rss_bytes(engine)
    success, message = engine.release_memory_occupation(["kv_cache"])
    assert success, message
    kv_dropped = resident - rss_bytes(engine)
    success, message = engine.release_memory_occupation(["weights"])
    assert success and "spill" in message, message
    weights_dropped = resident - kv_dropped - rss_bytes(engine)
    assert kv_dropped > 0.8 * kv_bytes, (kv_dropped, kv_bytes)
    assert weights_dropped > 0.8 * weight_bytes, (weights_dropped, weight_bytes)
    with ThreadPoolExecutor(1) as pool:  # a request while released waits for the memory to come back
        waiting = pool.submit(greedy, engine)
        time.sleep(0.3)
        assert not waiting.done()
        success, message = engine.resume_memory_occupation()
        assert success and "spill file" in message, message
        assert waiting.result(timeout=60)["output_ids"] == before


def checkpoint_bytes(model_dir: str) -> int:
    """float32 bytes of the model's weights, as the engine holds them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    """A served tiny llama behind an API key, with room for a whole model in one request body."""
    with ServerProcess(str(tiny_model_dirs["llama"]), {**EXACT, "max_total_tokens": 2048, "torch_num_threads": 1},
                       api_key="k", extra_args=("--max-request-bytes", str(64 << 20))) as started:
        yield started


AUTH = {"Authorization": "Bearer k"}


def post(server: ServerProcess, path: str, body: dict | str | None = None,
         headers: dict | None = None) -> requests.Response:
    sent = {"data": body} if isinstance(body, str) else {"json": body}  # str: JSON no encoder writes
    return requests.post(server.url + path, **sent, headers=AUTH if headers is None else headers, timeout=120)


def test_trainer_process_over_http_three_rounds_then_dies_mid_broadcast(server, tiny_model_dirs):
    """As slime and AReaL drive SGLang: the trainer inits the group once, then each round pauses, updates from
    distributed while it broadcasts, and continues, over HTTP, while clients keep sending requests."""
    model_dir = tiny_model_dirs["llama"]
    assert post(server, "/update_weights_from_disk", {"model_path": str(model_dir)}).json()["success"]
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rl_trainer.py")), str(model_dir),
                                server.url, "k", str(free_port()), "rollout"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    stop, outcomes = threading.Event(), []

    def client() -> None:  # each request ends: aborted by a pause (its partial output), or whole
        while not stop.is_set():
            reply = post(server, "/generate", {"input_ids": PROMPT[:20],
                                               "sampling_params": {**GREEDY, "max_new_tokens": 30}})
            outcomes.append((reply.status_code, reply.json()["meta_info"]["finish_reason"]["type"]))

    clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    try:
        assert trainer.stdout.readline().strip() == "joined"
        for thread in clients:
            thread.start()
        for round_number in (1, 2, 3):
            trainer.stdin.write(f"{round_number}\n")
            reply = json.loads(trainer.stdout.readline())
            assert reply["success"], reply
            expected = model_with(model_dir, round_weights(model_dir, round_number)).greedy(PROMPT, 8)
            generated = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
            assert generated["output_ids"] == expected
            assert generated["meta_info"]["weight_version"] == f"round-{round_number}"
        trainer.stdin.write("die 4\n")
        assert trainer.wait(timeout=60) == 1
        deadline = time.monotonic() + 60
        while post(server, "/continue_generation").json()["message"] != "generation continues":
            assert time.monotonic() < deadline, "the update never failed"  # it fails once the broadcast breaks
            time.sleep(0.2)
        generated = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
        assert generated["output_ids"] == expected, "a failed broadcast changed the weights"
        assert generated["meta_info"]["weight_version"] == "round-3"
        assert post(server, "/destroy_weights_update_group", {"group_name": "rollout"}).json()["success"]
    finally:
        stop.set()
        trainer.kill()
        trainer.wait()
        for thread in clients:
            thread.join(timeout=60)
    assert outcomes and all(status == 200 for status, _ in outcomes), outcomes[:5]
    assert {kind for _, kind in outcomes} <= {"abort", "length"}


def test_the_overlap_loop_pauses_and_updates_between_batches(engines, tiny_model_dirs):
    """The overlap loop has a batch in flight while the scheduler reads messages: pause and update wait for it."""
    overlap, model_dir = engines[2], tiny_model_dirs["llama"]
    with ThreadPoolExecutor(1) as pool:
        running = submit_running(pool, overlap, 300)
        assert overlap.pause_generation("abort")[0]
        assert running.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    new = round_weights(model_dir, 9)
    assert overlap.update_weights_from_tensor(list(new.items()))[0]
    assert overlap.continue_generation()[0]
    assert greedy(overlap)["output_ids"] == model_with(model_dir, new).greedy(PROMPT, 8)
    assert_pool_free(overlap)


def test_a_trainer_that_never_joins_fails_the_call_in_time(engine):
    before = greedy(engine)["output_ids"]
    started = time.monotonic()
    success, message = engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "ghost", "gloo", 3)
    assert not success and "could not join" in message, message
    assert time.monotonic() - started < 60
    assert greedy(engine)["output_ids"] == before


def test_tp2_update_from_tensor_each_rank_keeps_its_shard(engines, tiny_model_dirs):
    tp2 = engines[1]
    model_dir = tiny_model_dirs["llama"]
    new = round_weights(model_dir, 5)
    success, message = tp2.update_weights_from_tensor(list(new.items()), weight_version="tp")
    assert success, message
    assert greedy(tp2)["output_ids"] == model_with(model_dir, new).greedy(PROMPT, 8)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):  # the shards, joined
        assert torch.equal(torch.tensor(tp2.get_weights_by_name(name, 100)), new[name][:100]), name
    bad = tp2.update_weights_from_tensor([("model.layers.0.mlp.down_proj.weight", torch.ones(64, 127))])
    assert not bad[0] and "shape" in bad[1]
    assert greedy(tp2)["output_ids"] == model_with(model_dir, new).greedy(PROMPT, 8)
    assert tp2.release_memory_occupation()[0] and tp2.resume_memory_occupation()[0]
    assert greedy(tp2)["output_ids"] == model_with(model_dir, new).greedy(PROMPT, 8)
    assert_pool_free(tp2)


def test_http_routes_take_sglangs_bodies_behind_the_api_key(server, tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    assert post(server, "/pause_generation", {"mode": "abort"}, headers={}).status_code == 401
    new = round_weights(model_dir, 7)
    body = {"serialized_named_tensors": [serialize_named_tensors(new)], "flush_cache": True,
            "weight_version": "http"}
    reply = post(server, "/update_weights_from_tensor", body)
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert requests.get(server.url + "/get_weight_version", headers=AUTH).json() == {"weight_version": "http"}
    generated = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert generated["output_ids"] == model_with(model_dir, new).greedy(PROMPT, 8)
    assert generated["meta_info"]["weight_version"] == "http"
    rows = post(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3}).json()
    assert torch.equal(torch.tensor(rows), new["model.norm.weight"][:3])
    for path, bad in (("/update_weights_from_tensor", {"serialized_named_tensors": ["!!"]}),
                      ("/update_weights_from_tensor", {"serialized_named_tensors": "x"}),
                      ("/update_weights_from_distributed",
                       '{"names": ["a"], "dtypes": ["float32"], "shapes": [[1e309]]}'),
                      ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "1",
                                                      "rank_offset": 1, "world_size": 2}),
                      ("/release_memory_occupation", {"tags": ["everything"]}),
                      ("/pause_generation", {"mode": ["abort"]}),
                      ("/update_weights_from_disk", {}),
                      ("/update_weights_from_disk", {"model_path": "/nowhere"}),
                      ("/get_weights_by_name", {"name": {"a": 1}})):
        reply = post(server, path, bad)
        assert reply.status_code == 400 and reply.json()["success"] is False, (path, reply.text)
    for path, body in (("/pause_generation", {"mode": "retract"}), ("/release_memory_occupation", {}),
                       ("/resume_memory_occupation", {"tags": None}), ("/continue_generation", None)):
        reply = post(server, path, body)
        assert reply.status_code == 200 and reply.json()["success"], (path, reply.text)
    assert post(server, "/abort_request", {"abort_all": True}).json() == {"success": True}
    again = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert again["output_ids"] == generated["output_ids"]


def test_gguf_quantized_layers_refuse_updates_with_a_clear_error(tmp_path, monkeypatch):
    from furcate.runtime.model.weights.default_model import find_default_gguf, prepare_user_gguf
    from furcate.runtime.model.weights.loader import load_model
    from furcate.runtime.model.weights.quantize import apply_quantization
    from furcate.runtime.model.weights.weight_update import WeightWriter
    from furcate.runtime.wire.tensor_specs import TensorSpec
    from tiny_gguf import build_tiny_gguf

    monkeypatch.setenv("FURCATE_CACHE", str(tmp_path))
    model_dir = prepare_user_gguf(str(build_tiny_gguf(tmp_path / "tiny.gguf", find_default_gguf())))
    model = load_model(str(model_dir), torch.float32)
    assert apply_quantization(model, "gguf", str(model_dir)).layers
    writer = WeightWriter(model)
    hidden = model.config.hidden_size
    writer.plan([TensorSpec("model.norm.weight", torch.float32, (hidden,))])  # dense tensors still update
    with pytest.raises(ValueError, match="quantization='none'"):
        writer.plan([TensorSpec("model.layers.0.mlp.down_proj.weight", torch.float32,
                                (hidden, model.config.intermediate_size))])
