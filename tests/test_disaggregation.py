"""Prefill/decode disaggregation across real processes on loopback: a prefill and a decode furcate server behind
sglang-router in PD mode, K/V moved by Mooncake's transfer engine over TCP; outputs equal a single server's."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import requests

from furcate.runtime.server.launch import ServerProcess

from .conftest import EXACT, TINY_POOL_TOKENS, assert_server_pool_free
from .processes import descendants, free_port, start_router

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (pip install -e '.[dev]')")
try:
    from mooncake.engine import TransferEngine  # noqa: F401
except ImportError as error:  # the wheel loads libibverbs even for TCP
    pytest.skip(f"Mooncake's transfer engine is not usable here ({error}); pip install -e '.[dev]' and "
                f"apt-get install libibverbs1 libnl-route-3-200", allow_module_level=True)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PREAMBLE = "You are a careful assistant. Answer in one short sentence, and never repeat the question. "


def _server(model_dir, mode: str, **extra) -> ServerProcess:
    args = {"max_total_tokens": TINY_POOL_TOKENS, "torch_num_threads": 1, **EXACT,
            "disaggregation_mode": mode, "disaggregation_timeout": 20, **extra}
    return ServerProcess(str(model_dir), args)


@pytest.fixture(scope="module")
def pd(tiny_model_dirs):
    """(router URL, prefill server, decode server)."""
    bootstrap = free_port()
    prefill = _server(tiny_model_dirs["llama"], "prefill", disaggregation_bootstrap_port=bootstrap)
    decode = _server(tiny_model_dirs["llama"], "decode")
    router, url = start_router(["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap),
                                "--decode", decode.url], 2)
    yield url, prefill, decode
    router.terminate()
    router.wait(timeout=30)
    for server in (prefill, decode):
        server.stop()


def _generate(url: str, prompt: str, **extra) -> requests.Response:
    return requests.post(f"{url}/generate", json={"text": prompt, "sampling_params": GREEDY, **extra}, timeout=120)


def test_pd_outputs_equal_a_single_server(pd, tiny_server):
    url, prefill, decode = pd
    prompts = ["The capital of France is", "One two three", PREAMBLE + "What is rain?", PREAMBLE + "Why is ice cold?",
               PREAMBLE * 12 + "Long prompts move in few, large writes."]
    expected = {p: _generate(tiny_server.url, p).json()["output_ids"] for p in prompts}
    for prompt in prompts:  # one at a time, then all at once (they batch on both servers)
        routed = _generate(url, prompt)
        assert routed.status_code == 200, routed.text
        assert routed.json()["output_ids"] == expected[prompt]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: _generate(url, p), prompts * 2))
    for prompt, response in zip(prompts * 2, responses):
        assert response.status_code == 200, response.text
        assert response.json()["output_ids"] == expected[prompt]
    # The decode server's own prefix cache served the repeated preamble: only the rest was transferred.
    assert max(r.json()["meta_info"]["cached_tokens"] for r in responses[len(prompts):]) > 0
    stats = requests.get(f"{prefill.url}/get_server_info", timeout=30).json()["internal_states"][0]
    assert stats["kv_transfers"] >= 3 * len(prompts) and stats["kv_transfer_failures"] == 0
    for server in (prefill, decode):
        assert_server_pool_free(server.url)


def test_pd_streams_and_openai_client(pd, tiny_server):
    from openai import OpenAI

    url, prefill, decode = pd
    expected = _generate(tiny_server.url, "Streaming works when").json()["text"]
    with requests.post(f"{url}/generate", json={"text": "Streaming works when", "sampling_params": GREEDY,
                                                "stream": True}, stream=True, timeout=120) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith(b"data: {")]
    assert len(events) > 1
    assert requests.models.complexjson.loads(events[-1][6:])["text"] == expected
    served = requests.get(f"{tiny_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    results = []
    for base in (url, tiny_server.url):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        chat = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0)
        stream = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hey"}],
                                                max_tokens=6, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        results.append((chat.choices[0].message.content, streamed))
    assert results[0] == results[1]
    for server in (prefill, decode):
        assert_server_pool_free(server.url)


def test_a_request_without_its_pairing_is_refused(pd):
    _, prefill, decode = pd
    for server in (prefill, decode):
        response = _generate(server.url, "hello")
        assert response.status_code == 400 and "bootstrap_room" in response.json()["error"]["message"]
    bad = _generate(decode.url, "hello", bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=-3)
    assert bad.status_code == 400 and "bootstrap_room" in bad.json()["error"]["message"]


def test_failed_transfers_fail_alone_and_a_killed_prefill_server_fails_requests_cleanly(tiny_model_dirs):
    """A prefill request no decode server claims, a decode request whose prefill server never computes it, and
    one whose prefill server is gone each fail with a clear error; slots come back and the servers keep serving."""
    bootstrap = free_port()
    prefill = _server(tiny_model_dirs["llama"], "prefill", disaggregation_bootstrap_port=bootstrap,
                      disaggregation_timeout=1)
    decode = _server(tiny_model_dirs["llama"], "decode", disaggregation_timeout=1)
    router, url = start_router(["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap),
                                "--decode", decode.url], 2)
    pairing = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the same room twice: the later one fails at once
            twins = list(pool.map(lambda p: _generate(prefill.url, p, **pairing, bootstrap_room=7), ["Nobody", "No"]))
        messages = sorted(r.json()["error"]["message"] for r in twins)
        assert [r.status_code for r in twins] == [502, 502]
        assert "is taken by a request" in messages[0] and "no decode server claimed" in messages[1], messages
        response = _generate(decode.url, "Nobody sends this", **pairing, bootstrap_room=8)
        assert response.status_code == 502 and "did not send" in response.json()["error"]["message"]
        for server in (prefill, decode):
            assert_server_pool_free(server.url)
        assert _generate(url, "Before the crash").status_code == 200
        prefill.process.kill()
        prefill.process.wait(timeout=30)
        assert _generate(url, "After the crash").status_code >= 400
        direct = _generate(decode.url, "After the crash", **pairing, bootstrap_room=99)
        assert direct.status_code == 502 and "did not answer" in direct.json()["error"]["message"]
        assert requests.get(f"{decode.url}/health", timeout=10).status_code == 200
        assert_server_pool_free(decode.url)
    finally:
        router.terminate()
        router.wait(timeout=30)
        prefill.stop()
        decode.stop()


def test_serve_pd_disaggregation_over_nixl_starts_and_stops_everything_in_one_command(tiny_model_dirs, tiny_server):
    """`furcate serve --pd-disaggregation`, with K/V moved by NIXL (UCX) this time."""
    pytest.importorskip("nixl_cu12", reason="NIXL is a dev dependency (pip install -e '.[dev]')")
    server = ServerProcess(str(tiny_model_dirs["llama"]), {"max_total_tokens": TINY_POOL_TOKENS, **EXACT,
                                                           "disaggregation_transfer_backend": "nixl"},
                           extra_args=("--pd-disaggregation",))
    try:
        family = descendants(server.process.pid)
        assert len(family) >= 5, family  # a prefill and a decode server with a scheduler each, and the router
        for prompt in ("The capital of France is", PREAMBLE + "Why is ice cold?"):
            routed = _generate(server.url, prompt)
            assert routed.status_code == 200, routed.text
            assert routed.json()["output_ids"] == _generate(tiny_server.url, prompt).json()["output_ids"]
        workers = [w["url"] for w in requests.get(f"{server.url}/workers", timeout=30).json()["workers"]]
        infos = [requests.get(f"{url}/get_server_info", timeout=30).json() for url in workers]
        modes = sorted((i["disaggregation_mode"], i["disaggregation_transfer_backend"]) for i in infos)
        assert modes == [("decode", "nixl"), ("prefill", "nixl")], modes
    finally:
        assert server.stop() == 0
    still = [pid for pid in family if Path(f"/proc/{pid}").exists()]
    assert not still, f"processes left behind: {still}"
