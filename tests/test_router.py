"""Two furcate servers behind a real sglang-router (cache-aware policy) on loopback, as `serve --dp-size 2` starts
them: the router's rewritten requests are served (streamed ones too), outputs equal a single server's, and fan-out
routes reach both workers; `serve --dp-size 2` with the cache-aware and power-of-two policies."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from conftest import EXACT, NO_GRAMMAR, TINY_POOL_TOKENS, Revivable, assert_server_pool_free
from furcate.runtime.server.server_process import ServerProcess
from processes import descendants
from test_server_native import sse_events

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (pip install -e '.[dev]')")

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp_servers(tiny_model_dirs):
    shared = Revivable(lambda: ServerProcess(str(tiny_model_dirs["llama"]),
                                             {"max_total_tokens": TINY_POOL_TOKENS, **EXACT, **NO_GRAMMAR},
                                             extra_args=("--dp-size", "2")),
                       ServerProcess.stop, lambda server: server.process.poll() is None)
    yield shared
    shared.close()


@pytest.fixture
def dp_server(dp_servers) -> ServerProcess:
    """`furcate serve --dp-size 2` (two servers, one core each, behind sglang-router with its default cache-aware
    policy), shared by the module's tests; a new one when a test stopped it."""
    return dp_servers.get()


@pytest.fixture
def router(dp_server) -> str:
    return dp_server.url


@pytest.fixture
def workers(dp_server) -> list[str]:
    return [w["url"] for w in requests.get(f"{dp_server.url}/workers", timeout=30).json()["workers"]]


def test_generate_through_the_router_equals_a_single_server(router, tiny_server):
    # sglang-router 0.3.2 types /generate's text as one string (a list is its own 422), so one prompt per request.
    for prompt in ["The capital of France is", "One two three", "def f(x):"]:
        body = {"text": prompt, "sampling_params": GREEDY}
        direct = requests.post(f"{tiny_server.url}/generate", json=body, timeout=60).json()
        routed = requests.post(f"{router}/generate", json=body, timeout=60)
        assert routed.status_code == 200, routed.text
        assert routed.json()["output_ids"] == direct["output_ids"]


def test_openai_routes_through_the_router(router, tiny_server):
    from openai import OpenAI

    served = requests.get(f"{tiny_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    results = []
    for base in (router, tiny_server.url):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        completion = client.completions.create(model=served, prompt="Once upon a time", max_tokens=6, temperature=0)
        chat = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0)
        results.append((completion.choices[0].text, chat.choices[0].message.content))
    assert results[0] == results[1]


def test_generate_stream_through_the_router_equals_a_single_server(router, tiny_server):
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    direct = requests.post(f"{tiny_server.url}/generate", json=body, timeout=60).json()
    with requests.post(f"{router}/generate", json={**body, "stream": True}, stream=True, timeout=60) as routed:
        assert routed.status_code == 200, routed.text
        events = sse_events(routed)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # The router must pass the stream through as it comes, not buffer it into one event.
    assert len(chunks) > 1, chunks
    assert chunks[-1]["text"] == direct["text"]  # native chunks carry the text so far
    assert chunks[-1]["output_ids"] == direct["output_ids"]


def test_chat_stream_through_the_router_equals_a_single_server(router, tiny_server):
    from openai import OpenAI

    served = requests.get(f"{tiny_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    messages = [{"role": "user", "content": "Tell me about rivers"}]
    direct = OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused").chat.completions.create(
        model=served, messages=messages, max_tokens=8, temperature=0)
    stream = OpenAI(base_url=f"{router}/v1", api_key="unused").chat.completions.create(
        model=served, messages=messages, max_tokens=8, temperature=0, stream=True)
    deltas = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(deltas) > 1, deltas
    assert "".join(deltas) == direct.choices[0].message.content


def test_flush_cache_through_the_router_reaches_every_worker(router, workers):
    requests.post(f"{router}/generate", json={"text": "shared words " * 20, "sampling_params": GREEDY},
                  timeout=60).raise_for_status()
    assert requests.post(f"{router}/flush_cache", timeout=60).status_code == 200
    for url in workers:
        stats = requests.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
        assert stats["kv_available"] == stats["max_total_tokens"], stats
        assert_server_pool_free(url)


def test_workers_report_load_and_refuse_features_they_lack(workers):
    load = requests.get(f"{workers[0]}/get_load", timeout=30).json()
    assert isinstance(load, list) and {"num_tokens", "num_reqs", "num_waiting_reqs"} <= set(load[0])
    body = {"text": "hi", "sampling_params": GREEDY, "log_metrics": True, "return_hidden_states": True}
    refused = requests.post(f"{workers[0]}/generate", json=body, timeout=30)
    assert refused.status_code == 400 and "return_hidden_states" in refused.json()["error"]["message"]
    body["return_hidden_states"] = False
    assert requests.post(f"{workers[0]}/generate", json=body, timeout=30).status_code == 200


def test_chat_route_takes_the_routers_added_fields(workers):
    served = requests.get(f"{workers[0]}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": served, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
            "continue_final_message": False}
    assert requests.post(f"{workers[0]}/v1/chat/completions", json=body, timeout=60).status_code == 200
    refused = requests.post(f"{workers[0]}/v1/chat/completions", json={**body, "continue_final_message": True},
                            timeout=60)
    assert refused.status_code == 400 and "continue_final_message" in refused.json()["error"]["message"]


def test_serve_dp_size_two_routes_shared_prefixes_to_one_worker_and_stops_everything(dp_server, workers, tiny_server):
    import concurrent.futures

    server = dp_server  # stopped here: a later test that needs it gets a new one
    try:
        family = descendants(server.process.pid)
        # Two workers with a scheduler each, and the router.
        assert len(family) >= 5, family
        assert len(workers) == 2
        for url in workers:  # the module's other tests used them: from a cold cache, as a new server has
            assert_server_pool_free(url)
        body = {"text": "The capital of France is", "sampling_params": GREEDY}
        direct = requests.post(f"{tiny_server.url}/generate", json=body, timeout=60).json()
        assert requests.post(f"{server.url}/generate", json=body, timeout=60).json()["output_ids"] == \
            direct["output_ids"]
        prefix = "a long shared preamble about rivers and stones " * 8
        first = requests.post(f"{server.url}/generate", json={"text": prefix + "first", "sampling_params": GREEDY},
                              timeout=60).json()
        assert first["meta_info"]["cached_tokens"] == 0
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: requests.post(
                f"{server.url}/generate", json={"text": prefix + f"question {i}", "sampling_params": GREEDY},
                timeout=60).json(), range(4)))
        # Cache-aware routing sends every request sharing the preamble to the worker that cached it.
        assert all(o["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 2 for o in outs), outs
    finally:
        assert server.stop() == 0
    still = [pid for pid in family if Path(f"/proc/{pid}").exists()]
    assert not still, f"processes left behind: {still}"


def test_runtime_with_dp_size_runs_programs_across_replicas_under_power_of_two(tiny_model_dirs, tiny_server):
    import concurrent.futures

    import furcate as sgl

    @sgl.function
    def continue_text(s, text):
        s += text + sgl.gen("more", max_tokens=6, temperature=0)

    texts = ("Once upon a time", "The river", "def f(x):")
    with sgl.Runtime(str(tiny_model_dirs["llama"]), dp_size=2, router_policy="power_of_two",
                     max_total_tokens=TINY_POOL_TOKENS, **EXACT, **NO_GRAMMAR) as runtime:
        routed = [state["more"] for state in continue_text.run_batch([{"text": t} for t in texts], backend=runtime)]
        # Ties in load go to a random one of the two choices, so 16 requests all landing on one worker would
        # take a 2^-15 chance even if the policy ignored load altogether.
        prompts = [f"question {i} about rivers" for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda p: requests.post(f"{runtime.url}/generate", json={
                "text": p, "sampling_params": GREEDY}, timeout=60), prompts))
        assert all(o.status_code == 200 for o in outs), [o.text for o in outs if o.status_code != 200]
        # The router lists the workers it registered; each one's own counter says what it served.
        workers = [w["url"] for w in requests.get(f"{runtime.url}/workers", timeout=30).json()["workers"]]
        served = [_requests_served(url) for url in workers]
    assert len(workers) == 2 and sum(served) >= len(texts) + len(prompts) and min(served) > 0, served
    direct = sgl.RuntimeEndpoint(tiny_server.url)
    try:
        expected = [continue_text.run(text=t, backend=direct)["more"] for t in texts]
    finally:
        direct.close()
    assert routed == expected


def _requests_served(worker_url: str) -> int:
    """Requests the worker finished, from its Prometheus counter (summed over finish reasons)."""
    text = requests.get(f"{worker_url}/metrics", timeout=30).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("furcate_requests_total{")))
