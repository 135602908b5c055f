"""The native HTTP API against a live server (tiny llama model): every route, batch and stream, logprob formats,
abort by rid and by disconnect. Greedy outputs are checked against HF transformers on the same weights."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from conftest import assert_server_pool_free

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def post(url: str, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=120, **kwargs)


def sse_events(response: requests.Response) -> list:
    """The `data:` payloads of an SSE response, parsed; the final `[DONE]` is kept as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def wait_until_idle(url: str, guard_s: float = 60) -> None:
    """Poll until nothing runs or waits (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        stats = requests.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
        if stats["running"] == 0 and stats["waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"requests still in flight after {guard_s}s: {stats}")


def long_generation(server: str) -> dict:
    """Sampling params for a request that runs as long as the context allows: long enough to abort mid-way."""
    room = requests.get(f"{server}/get_model_info", timeout=30).json()["max_req_len"] - 16
    return {"max_new_tokens": room, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def server(tiny_server):
    yield tiny_server.url
    assert_server_pool_free(tiny_server.url)


def test_health_routes(server):
    assert requests.get(f"{server}/health", timeout=30).status_code == 200
    assert requests.get(f"{server}/health_generate", timeout=60).status_code == 200


def test_model_and_server_info(server, tiny_model_dirs):
    info = requests.get(f"{server}/get_model_info", timeout=30).json()
    assert info["model_path"] == str(tiny_model_dirs["llama"]) and info["tokenizer_path"]
    assert info["is_generation"] is True and info["vocab_size"] > 0
    for path in ("/server_info", "/get_server_info"):
        body = requests.get(f"{server}{path}", timeout=30).json()
        assert body["max_total_tokens"] > 0 and body["internal_states"][0]["max_total_tokens"] > 0
        assert body["tp_size"] == 1
        assert "api_key" not in body


def test_generate_greedy_equals_hf(server, hf_reference, tokenizer):
    prompt = "The quick brown fox"
    out = post(server, "/generate", {"text": prompt, "sampling_params": GREEDY}).json()
    ids = tokenizer.encode(prompt)
    assert out["output_ids"] == hf_reference("llama").greedy(ids, 8)
    assert out["text"] == tokenizer.decode(out["output_ids"])
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 8
    assert meta["finish_reason"]["type"] == "length" and meta["e2e_latency"] > 0 and meta["id"]
    by_ids = post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == out["output_ids"]


def test_batch_keeps_order_and_matches_singles(server):
    prompts = ["One two", "Hello there, friend", "A"]
    batch = post(server, "/generate", {"text": prompts, "sampling_params": GREEDY}).json()
    singles = [post(server, "/generate", {"text": p, "sampling_params": GREEDY}).json() for p in prompts]
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    ids_batch = post(server, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": GREEDY}).json()
    assert len(ids_batch) == 2 and all(r["meta_info"]["completion_tokens"] == 8 for r in ids_batch)
    n_batch = post(server, "/generate", {"text": ["x", "y"], "sampling_params": {**GREEDY, "n": 2}}).json()
    assert len(n_batch) == 4


def test_logprob_formats(server, hf_reference, tokenizer):
    prompt = "Counting: one two three"
    ids = tokenizer.encode(prompt)
    body = {"text": prompt, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 3, "return_text_in_logprobs": True}
    meta = post(server, "/generate", body).json()["meta_info"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [entry[1] for entry in inputs] == ids and inputs[0][0] is None
    assert all(entry[2] == tokenizer.decode([entry[1]]) for entry in inputs + outputs)
    reference = hf_reference("llama").logprobs(ids)
    for position in range(1, len(ids)):
        assert inputs[position][0] == pytest.approx(reference[position - 1, ids[position]].item(), abs=1e-3)
    assert len(outputs) == 8 and len(meta["output_top_logprobs"]) == 8
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the most likely one.
    assert all(top[0][1] == entry[1] for top, entry in zip(meta["output_top_logprobs"], outputs))
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(ids)
    plain = post(server, "/generate", {**body, "return_text_in_logprobs": False, "top_logprobs_num": 0}).json()
    assert all(entry[2] is None for entry in plain["meta_info"]["output_token_logprobs"])
    assert "output_top_logprobs" not in plain["meta_info"]


def test_stream_is_cumulative_with_incremental_logprobs(server):
    body = {"text": "Stream me", "sampling_params": {**GREEDY, "max_new_tokens": 12}, "return_logprob": True}
    whole = post(server, "/generate", body).json()
    response = post(server, "/generate", {**body, "stream": True}, stream=True)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert texts[-1] == whole["text"]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == sorted(c["meta_info"]["completion_tokens"]
                                                                          for c in chunks)
    streamed = [entry for c in chunks for entry in c["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in streamed] == [e[1] for e in whole["meta_info"]["output_token_logprobs"]]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_streamed_logprobs_carry_the_running_count(server):
    """SGLang's output_token_logprobs_length: the count of entries so far, beside each chunk's new entries."""
    body = {"text": "Count me", "sampling_params": {**GREEDY, "max_new_tokens": 10}, "return_logprob": True}
    whole = post(server, "/generate", body).json()["meta_info"]
    assert whole["output_token_logprobs_length"] == len(whole["output_token_logprobs"]) == 10
    chunks = sse_events(post(server, "/generate", {**body, "stream": True}, stream=True))[:-1]
    previous = 0
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - previous
        previous = meta["completion_tokens"]
    assert previous == 10


def test_concate_and_append_request_answers_sglangs_client(server):
    """The parallel-encoding join of SGLang's client: it holds the joined text itself and sends it next."""
    reply = post(server, "/concate_and_append_request", {"src_rids": ["a", "b"], "dst_rid": "parent"})
    assert reply.status_code == 200 and reply.json()["success"] is True


@pytest.mark.parametrize(("body", "named"), [
    ({"dst_rid": "parent"}, "src_rids"),
    ({"src_rids": ["a"]}, "dst_rid"),
    ({"src_rids": "a", "dst_rid": "parent"}, "src_rids"),
    ({"src_rids": [], "dst_rid": "parent"}, "src_rids"),
    ({"src_rids": ["a", 7], "dst_rid": "parent"}, "7"),
    ({"src_rids": ["a"], "dst_rid": ["parent"]}, "dst_rid"),
    ({"src_rids": ["a"], "dst_rid": ""}, "dst_rid"),
    ({"src_rids": ["x" * 300], "dst_rid": "parent"}, "256"),
    ({"src_rids": ["a"] * 100_000, "dst_rid": "parent"}, "a list of 100000"),
    ({"src_rids": ["a"], "dst_rid": "parent", "extra": 1}, "extra"),
])
def test_concate_and_append_request_refuses_bad_bodies(server, body, named):
    reply = post(server, "/concate_and_append_request", body)
    assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text
    assert requests.get(f"{server}/health_generate", timeout=60).status_code == 200  # still serving


def test_stop_regex_and_stop_strings(server, tokenizer):
    free = post(server, "/generate", {"text": "Go", "sampling_params": {**GREEDY, "max_new_tokens": 16}}).json()
    text = free["text"]
    assert len(text) > 3
    cut = text[2:4]
    stopped = post(server, "/generate", {"text": "Go", "sampling_params": {**GREEDY, "max_new_tokens": 16,
                                                                           "stop": cut}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": cut}
    assert stopped["text"] == text[: text.index(cut)]
    by_regex = post(server, "/generate", {"text": "Go", "sampling_params": {
        **GREEDY, "max_new_tokens": 16, "stop_regex": [json.dumps(cut)[1:-1].replace(".", r"\.")]}}).json()
    assert by_regex["meta_info"]["finish_reason"]["type"] == "stop"


def test_abort_request_by_rid(server):
    body = {"text": "long", "rid": "to-abort", "stream": True, "sampling_params": long_generation(server)}
    response = post(server, "/generate", body, stream=True)
    lines = response.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))  # it runs
    assert post(server, "/abort_request", {"rid": "to-abort"}).json() == {"success": True}
    events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < body["sampling_params"]["max_new_tokens"]
    wait_until_idle(server)


def test_batch_abort_by_base_rid(server):
    done: list = []
    body = {"text": ["a", "b"], "rid": "batch-rid", "sampling_params": long_generation(server)}
    worker = threading.Thread(target=lambda: done.append(post(server, "/generate", body).json()))
    worker.start()
    deadline = time.monotonic() + 60
    while requests.get(f"{server}/get_server_info", timeout=30).json()["internal_states"][0]["running"] < 2:
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.05)
    post(server, "/abort_request", {"rid": "batch-rid"})
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in done[0])


def _raw_post(server: str, body: dict) -> socket.socket:
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def metric(server: str, name: str) -> float:
    for line in requests.get(f"{server}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_memory(server, stream):
    aborted = 'furcate_requests_total{finish_reason="abort"}'
    before = metric(server, aborted)
    body = {"text": "disconnect me", "stream": stream, "sampling_params": long_generation(server)}
    sock = _raw_post(server, body)
    deadline = time.monotonic() + 60
    while requests.get(f"{server}/get_server_info", timeout=30).json()["internal_states"][0]["running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    if stream:
        assert sock.recv(100)  # headers and the first chunks are flowing
    sock.close()
    wait_until_idle(server)
    assert metric(server, aborted) == before + 1  # it was aborted, not run to its last token


@pytest.mark.parametrize("stream", [False, True])
def test_bootstrap_fields_reach_the_engine_and_a_whole_server_refuses_them(server, stream):
    """Both routes hand the router's pairing fields to the engine (typed); a server that is neither half of a
    prefill/decode pair answers 400 naming them, before any stream opens."""
    generate = post(server, "/generate", {"text": "hi", "sampling_params": GREEDY, "stream": stream,
                                          "bootstrap_room": 7})
    completion = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": stream,
                                                  "bootstrap_host": "127.0.0.1", "bootstrap_room": 7})
    assert generate.status_code == 400 and "bootstrap_room: bootstrap fields" in generate.text
    assert completion.status_code == 400 and "bootstrap_host, bootstrap_room: bootstrap fields" in completion.text


def test_flush_cache_tokenize_detokenize(server, tokenizer):
    flushed = requests.post(f"{server}/flush_cache", json={"empty_cache": True}, timeout=30)
    assert flushed.status_code == 200 and flushed.json()["success"] is True
    assert requests.get(f"{server}/flush_cache", timeout=30).status_code == 200
    one = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert one["tokens"] == tokenizer.encode("Hello world") and one["count"] == len(one["tokens"])
    many = post(server, "/tokenize", {"prompt": ["a b", "c"]}).json()
    assert many["tokens"] == [tokenizer.encode("a b"), tokenizer.encode("c")]
    assert post(server, "/detokenize", {"tokens": one["tokens"]}).json()["text"] == "Hello world"


def test_metrics(server):
    post(server, "/generate", {"text": "metrics", "sampling_params": GREEDY})
    post(server, "/generate", {"text": "metrics", "sampling_params": GREEDY})  # a prefix-cache hit
    response = requests.get(f"{server}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['furcate_requests_total{finish_reason="length"}'] >= 2
    assert values["furcate_generation_tokens_total"] >= 16 and values["furcate_prompt_tokens_total"] > 0
    assert values["furcate_time_to_first_token_seconds_count"] >= 2
    assert values["furcate_inter_token_latency_seconds_count"] >= 14
    assert values["furcate_e2e_request_latency_seconds_count"] >= 2
    assert 0 < values["furcate_cache_hit_rate"] <= 1
    assert values["furcate_num_queue_reqs"] == 0 and values["furcate_num_running_reqs"] == 0
    assert 0 <= values["furcate_kv_usage"] <= 1
