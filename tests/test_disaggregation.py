"""Prefill/decode disaggregation across real processes on loopback: a prefill and a decode furcate server behind
sglang-router in PD mode, K/V moved by Mooncake's transfer engine over TCP; outputs equal a single server's."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import requests

from conftest import EXACT, NO_GRAMMAR, TINY_POOL_TOKENS, Revivable, assert_server_pool_free
from furcate.runtime.server.server_process import ServerProcess
from processes import descendants, free_port, start_router

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (pip install -e '.[dev]')")
try:
    from mooncake.engine import TransferEngine  # noqa: F401 - imported only to learn whether it loads
except ImportError as error:  # the wheel loads libibverbs even for TCP
    pytest.skip(f"Mooncake's transfer engine is not usable here ({error}); pip install -e '.[dev]' and "
                f"apt-get install libibverbs1 libnl-route-3-200", allow_module_level=True)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PREAMBLE = "You are a careful assistant. Answer in one short sentence, and never repeat the question. "
# How long a prefill server holds K/V no decode server claimed, and a decode server waits for K/V it claimed. Short,
# so the failure test waits seconds for what no peer does; loopback transfers of the tiny model take milliseconds.
TIMEOUT_S = 5


def _server(model_dir, mode: str, **extra) -> ServerProcess:
    args = {"max_total_tokens": TINY_POOL_TOKENS, "torch_num_threads": 1, **EXACT, **NO_GRAMMAR,
            "disaggregation_mode": mode, "disaggregation_timeout": TIMEOUT_S, **extra}
    return ServerProcess(str(model_dir), args)


class PD:
    """A prefill and a decode server (started side by side: start-up is one core's work) behind sglang-router in
    PD mode."""

    def __init__(self, model_dir) -> None:
        self.bootstrap = free_port()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = [pool.submit(_server, model_dir, "prefill", disaggregation_bootstrap_port=self.bootstrap),
                       pool.submit(_server, model_dir, "decode")]
        try:
            self.servers = [future.result() for future in started]
            self.prefill, self.decode = self.servers
            self.router, self.url = start_router(["--pd-disaggregation", "--prefill", self.prefill.url,
                                                  str(self.bootstrap), "--decode", self.decode.url], 2)
        except BaseException:
            for future in started:
                if future.exception() is None:
                    future.result().stop()
            raise

    def alive(self) -> bool:
        return all(p.poll() is None for p in (self.router, self.prefill.process, self.decode.process))

    def stop(self) -> None:
        self.router.terminate()
        self.router.wait(timeout=30)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(ServerProcess.stop, self.servers))


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dirs):
    cluster = Revivable(lambda: PD(tiny_model_dirs["llama"]), PD.stop, PD.alive)
    yield cluster
    cluster.close()


@pytest.fixture
def pd(pd_cluster) -> PD:
    """The module's PD servers and router; new ones if a test killed a server."""
    return pd_cluster.get()


def _generate(url: str, prompt: str, **extra) -> requests.Response:
    return requests.post(f"{url}/generate", json={"text": prompt, "sampling_params": GREEDY, **extra}, timeout=120)


def test_pd_outputs_equal_a_single_server(pd, tiny_server):
    url, prefill, decode = pd.url, pd.prefill, pd.decode
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

    url, prefill, decode = pd.url, pd.prefill, pd.decode
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
    prefill, decode = pd.prefill, pd.decode
    for server in (prefill, decode):
        response = _generate(server.url, "hello")
        assert response.status_code == 400 and "bootstrap_room" in response.json()["error"]["message"]
    bad = _generate(decode.url, "hello", bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=-3)
    assert bad.status_code == 400 and "bootstrap_room" in bad.json()["error"]["message"]


def test_failed_transfers_fail_alone_and_a_killed_prefill_server_fails_requests_cleanly(pd):
    """A prefill request no decode server claims, a decode request whose prefill server never computes it, and
    one whose prefill server is gone each fail with a clear error; slots come back and the servers keep serving.
    The prefill server is killed: the next test to use the PD servers gets new ones."""
    url, prefill, decode = pd.url, pd.prefill, pd.decode
    pairing = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap}
    # The same room twice on the prefill server (the later one fails at once, the other when no decode server
    # claimed it) and, meanwhile, a room the decode server claims that its prefill server never computes: the two
    # waits for a peer run side by side.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        twins = [pool.submit(_generate, prefill.url, p, **pairing, bootstrap_room=7) for p in ["Nobody", "No"]]
        unsent = pool.submit(_generate, decode.url, "Nobody sends this", **pairing, bootstrap_room=8)
        twins = [future.result() for future in twins]
        response = unsent.result()
    messages = sorted(r.json()["error"]["message"] for r in twins)
    assert [r.status_code for r in twins] == [502, 502]
    assert "is taken by a request" in messages[0] and "no decode server claimed" in messages[1], messages
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


def test_serve_pd_disaggregation_over_nixl_starts_and_stops_everything_in_one_command(tiny_model_dirs, tiny_server):
    """`furcate serve --pd-disaggregation`, with K/V moved by NIXL (UCX) this time."""
    pytest.importorskip("nixl_cu12", reason="NIXL is a dev dependency (pip install -e '.[dev]')")
    server = ServerProcess(str(tiny_model_dirs["llama"]), {"max_total_tokens": TINY_POOL_TOKENS, **EXACT, **NO_GRAMMAR,
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
