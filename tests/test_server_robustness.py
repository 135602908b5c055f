"""A hostile client against a live server: each bad request gets a 4xx JSON error naming the problem, for that
request alone, while good requests running beside it finish unchanged. Also the API key, 503 on a full queue, the
body size limit, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from conftest import NO_GRAMMAR, TINY_POOL_TOKENS, Revivable, assert_server_pool_free
from furcate.runtime.server.server_process import ServerProcess

GOOD = {"text": "A steady request", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, body, a word the error must contain). Bodies given as bytes are sent raw.
BAD_REQUESTS = [
    ("/generate", b"{not json", "malformed JSON"),
    ("/generate", b"", "empty"),
    ("/generate", b"[1, 2]", "JSON object"),
    ("/generate", b"\xff\xfe", "UTF-8"),
    ("/generate", b'{"text": "x", "sampling_params": {"temperature": NaN}}', "temperature"),
    ("/generate", b'{"text": "x", "sampling_params": {"top_p": Infinity}}', "top_p"),
    ("/generate", b'{"text": "\\ud800"}', "not valid text"),
    ("/generate", {"text": "x", "surprise": 1}, "surprise"),
    ("/generate", {"text": {"a": 1}}, "prompt"),
    ("/generate", {"text": "x", "input_ids": [1]}, "not both"),
    ("/generate", {"input_ids": [-1, 2]}, "vocabulary"),
    ("/generate", {"input_ids": [[1], "x"]}, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": [1]}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1e30}}, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"n": 10**9}}, "n must be"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": {"type": "no-such-type"}}}, "schema"),
    ("/generate", {"text": "x", "sampling_params": {"stop_regex": "("}}, "stop_regex"),
    ("/generate", {"text": "x", "sampling_params": {"stop": ["a"] * 1000}}, "stop"),
    ("/generate", {"text": "x", "stream": "yes"}, "stream"),
    ("/generate", {"text": "x", "rid": 5}, "rid"),
    ("/generate", {"text": "x", "return_logprob": 1}, "return_logprob"),
    ("/generate", {"text": "x", "top_logprobs_num": 3}, "return_logprob"),
    ("/generate", {"text": "x", "image_data": "aGk="}, "image_data"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ("/generate", {"text": "x " * 5000, "sampling_params": {"max_new_tokens": 1}}, "tokens"),
    ("/generate", {"text": ["ok", "x"], "sampling_params": [{}, {"temperature": -1}]}, "temperature"),
    ("/abort_request", {"rid": ["a"]}, "rid"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [10**12]}, "tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}, "frobnicate"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": {"role": "user"}}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "schema"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, "max_new_tokens"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "regex": "("}, "regex"),
]


def send(url: str, route: str, body) -> requests.Response:
    if isinstance(body, bytes):
        return requests.post(f"{url}{route}", data=body, headers={"Content-Type": "application/json"}, timeout=120)
    return requests.post(f"{url}{route}", json=body, timeout=120)


def run_good(url: str) -> dict:
    return send(url, "/generate", GOOD).json()


@pytest.fixture(scope="module")
def server(tiny_server):
    yield tiny_server.url
    assert_server_pool_free(tiny_server.url)


@pytest.fixture(scope="module")
def good_reference(server) -> dict:
    return run_good(server)


@pytest.mark.parametrize(("route", "body", "named"), BAD_REQUESTS,
                         ids=[f"{route}-{index}" for index, (route, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_fails_alone(server, good_reference, route, body, named):
    with ThreadPoolExecutor(2) as pool:
        good = [pool.submit(run_good, server) for _ in range(2)]
        response = send(server, route, body)
        assert [g.result()["output_ids"] for g in good] == [good_reference["output_ids"]] * 2
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert named.lower() in error["message"].lower(), error
    assert error["code"] == response.status_code and error["type"]


def test_unknown_route_and_method(server):
    missing = requests.get(f"{server}/no/such/route", timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = requests.get(f"{server}/generate", timeout=30)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_body_size_limit(server):
    response = send(server, "/generate", b'{"text": "' + b"x" * (17 * 1024 * 1024) + b'"}')
    assert response.status_code == 413 and "too large" in response.json()["error"]["message"]
    assert run_good(server)["meta_info"]["completion_tokens"] == 24


def test_list_with_a_failing_item_leaves_nothing_running(server):
    # The second item's grammar fails to compile in the scheduler, after the first one was already queued.
    body = {"text": ["fine", "broken"], "sampling_params": [
        {"max_new_tokens": 200, "ignore_eos": True}, {"max_new_tokens": 8, "ebnf": "root ::= undefined_rule"}]}
    response = send(server, "/generate", body)
    assert response.status_code == 400, response.text
    deadline = time.monotonic() + 60
    while True:
        stats = requests.get(f"{server}/get_server_info", timeout=30).json()["internal_states"][0]
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_sglang_runtime_endpoint_requests(server):
    """The exact requests SGLang's RuntimeEndpoint client sends (see COMPAT.md), answered as it expects."""
    info = requests.get(f"{server}/get_model_info", timeout=30).json()
    assert info["model_path"]
    assert requests.post(f"{server}/flush_cache", json={"empty_cache": True}, timeout=30).status_code == 200
    sampling = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 6,
                "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": None, "stop_regex": None,
                "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}
    out = send(server, "/generate", {"text": "Hello", "sampling_params": sampling, "return_logprob": False,
                                     "logprob_start_len": -1, "top_logprobs_num": 0,
                                     "return_text_in_logprobs": False}).json()
    assert isinstance(out["text"], str) and out["meta_info"]["completion_tokens"] <= 6
    prefix = send(server, "/generate", {"text": "Pick one:", "sampling_params": {"max_new_tokens": 0}}).json()
    start = max(prefix["meta_info"]["prompt_tokens"] - 2, 0)
    scored = send(server, "/generate", {"text": ["Pick one: yes", "Pick one: no"],
                                        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                        "return_logprob": True, "return_text_in_logprobs": True,
                                        "logprob_start_len": start}).json()
    for result in scored:
        # The client subtracts the first entry's logprob when no token healing happened: it must be a number.
        entries = result["meta_info"]["input_token_logprobs"]
        assert isinstance(entries[0][0], float) and isinstance(entries[0][2], str)
        assert result["meta_info"]["output_token_logprobs"] == []
    unconditional = send(server, "/generate", {"input_ids": [[e[1] for e in r["meta_info"]["input_token_logprobs"]]
                                                             for r in scored],
                                               "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    assert unconditional.status_code == 200 and len(unconditional.json()) == 2
    stream = requests.post(f"{server}/generate", json={"text": "Hello", "sampling_params": sampling, "stream": True},
                           stream=True, timeout=120)
    lines = [line.decode() for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][5:].strip("\n"))["text"] == out["text"]


# -- a server of its own: an API key with a one-slot queue; shutdown -----------------------------------------------

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def guarded_servers(tiny_model_dirs):
    args = {"max_total_tokens": TINY_POOL_TOKENS, "torch_num_threads": 2, "dtype": "float32", "max_running_requests": 1,
            "max_queued_requests": 1, **NO_GRAMMAR}
    shared = Revivable(lambda: ServerProcess(str(tiny_model_dirs["llama"]), args, api_key="s3cret"),
                       ServerProcess.stop, lambda server: server.process.poll() is None)
    yield shared
    shared.close()


@pytest.fixture
def guarded(guarded_servers) -> ServerProcess:
    """The module's server with an API key and a one-slot queue; a new one when a test stopped it."""
    return guarded_servers.get()


@pytest.fixture
def guarded_server(guarded) -> str:
    return guarded.url


def test_api_key(guarded_server):
    url = guarded_server
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    assert requests.get(f"{url}/health_generate", timeout=60).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for method, route in (("post", "/generate"), ("get", "/get_model_info"), ("get", "/v1/models"),
                              ("get", "/metrics"), ("post", "/flush_cache")):
            response = requests.request(method, f"{url}{route}", json=GOOD, headers=headers, timeout=30)
            assert response.status_code == 401, (route, headers)
            assert "API key" in response.json()["error"]["message"]
    ok = requests.post(f"{url}/generate", json=GOOD, headers={"Authorization": "Bearer s3cret"}, timeout=120)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 24


def test_full_queue_answers_503_at_once(guarded_server):
    url, headers = guarded_server, {"Authorization": "Bearer s3cret"}
    room = requests.get(f"{url}/get_model_info", headers=headers, timeout=30).json()["max_req_len"] - 16
    long = {"sampling_params": {"max_new_tokens": room, "ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:
        occupying = [pool.submit(requests.post, f"{url}/generate", json={"text": f"occupy {i}", "rid": f"occupy-{i}",
                                                                        **long}, headers=headers, timeout=300)
                     for i in range(2)]
        try:
            deadline = time.monotonic() + 60
            while True:  # one running, one queued: the limit
                stats = requests.get(f"{url}/get_server_info", headers=headers, timeout=30).json()
                if stats["internal_states"][0]["running"] + stats["internal_states"][0]["waiting"] == 2:
                    break
                assert time.monotonic() < deadline, stats["internal_states"]
                time.sleep(0.02)
            refused = requests.post(f"{url}/generate", json=GOOD, headers=headers, timeout=60)
            assert refused.status_code == 503 and "queue is full" in refused.json()["error"]["message"]
            assert refused.headers["Retry-After"] == "1"  # full, not broken: clients and routers come back
            chat = requests.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
            assert chat.status_code == 503
        finally:
            for i in range(2):
                requests.post(f"{url}/abort_request", json={"rid": f"occupy-{i}"}, headers=headers, timeout=30)
        assert all(f.result().json()["meta_info"]["finish_reason"]["type"] == "abort" for f in occupying)
    assert_server_pool_free(url, headers)


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(guarded):
    server = guarded  # stopped here: a later test that needs it gets a new one
    scheduler = _children(server.process.pid)
    assert scheduler, "the server should run its scheduler in a child process"
    results: list = []
    body = {"text": "in flight", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: results.append(requests.post(f"{server.url}/generate", json=body,
                                                                          headers=KEY, timeout=120)))
    worker.start()
    deadline = time.monotonic() + 60
    while not requests.get(f"{server.url}/get_server_info", headers=KEY,
                           timeout=30).json()["internal_states"][0]["running"]:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) == 0
    worker.join(timeout=60)
    assert results[0].status_code == 200 and results[0].json()["meta_info"]["completion_tokens"] == 64
    assert not any(_alive(pid) for pid in scheduler)
    assert "furcate server shutting down" in server.output
