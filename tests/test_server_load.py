"""Load and faults against a live server, and an engine whose scheduler cannot read.

A small version of the run a busy deployment sees: concurrent streamed and whole requests on the native and OpenAI
routes, clients that vanish mid-stream or read slowly, aborts, malformed requests and long prompts, with the
scheduler frozen (SIGSTOP: a forward step that does not end) for part of it. Every good request answers with the
text it gives alone, every malformed one a 4xx, /health and /get_load answer within a second throughout, aborts
answer while the scheduler is frozen, and the KV pool is whole afterwards. Then, in-process: requests given to an
engine whose scheduler is frozen never block their caller, past max_pending_requests they are refused at once, an
aborted one still waiting to be sent ends at once, and the rest run when the scheduler resumes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import psutil
import pytest

from conftest import EXACT, TINY_POOL_TOKENS, assert_pool_free, assert_server_pool_free
from furcate.runtime.engine.engine import Engine, QueueFullError
from furcate.runtime.engine.launch import SCHEDULER_MODULE

PROMPTS = [f"Request number {i} asks about" for i in range(8)]
TOKENS = 16
GREEDY = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
RESPONSIVE_S = 1.0  # the bound for /health, /get_load and /abort_request under load
MALFORMED = [("/generate", {"text": "x", "sampling_params": {"temperature": float("nan")}}),
             ("/generate", {"text": {"a": 1}}),
             ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
             ("/v1/chat/completions", {"messages": {"role": "user"}}),
             ("/generate", {"input_ids": [-1, 2]})]
CLIENTS = 64


@contextlib.contextmanager
def frozen_schedulers(server_pid: int) -> Iterator[None]:
    """Freeze every scheduler process under the server (the serving one and a spare), then let them go on."""
    schedulers = [p for p in psutil.Process(server_pid).children(recursive=True)
                  if SCHEDULER_MODULE in " ".join(p.cmdline())]
    assert schedulers, "no scheduler process found under the server"
    for process in schedulers:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in schedulers:
            process.send_signal(signal.SIGCONT)


class Probe:
    """Hits the routes that must never wait for the scheduler, every 20 ms, and keeps the slowest answer."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.slowest: dict[str, float] = {"/health": 0.0, "/get_load": 0.0}
        self.running = True

    async def run(self) -> None:
        while self.running:
            for route in self.slowest:
                began = time.monotonic()
                async with self.session.get(f"{self.url}{route}") as response:
                    assert response.status == 200, (route, await response.text())
                    await response.read()
                self.slowest[route] = max(self.slowest[route], time.monotonic() - began)
            await asyncio.sleep(0.02)


async def native(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(f"{url}/generate", json=body) as response:
        return response.status, await response.json()


async def sse(response: aiohttp.ClientResponse, pause: float = 0.0) -> list:
    """The data payloads of a stream, read `pause` seconds apart (a slow reader); [DONE] dropped."""
    events = []
    async for line in response.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
            await asyncio.sleep(pause)
    return events


async def native_stream(session: aiohttp.ClientSession, url: str, prompt: str, pause: float) -> str:
    body = {"text": prompt, "sampling_params": GREEDY, "stream": True}
    async with session.post(f"{url}/generate", json=body) as response:
        assert response.status == 200
        return (await sse(response, pause))[-1]["text"]  # native events carry the text so far


async def completion(session: aiohttp.ClientSession, url: str, prompt: str, stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if stream:
            return "".join(event["choices"][0]["text"] for event in await sse(response))
        return (await response.json())["choices"][0]["text"]


async def disconnect(session: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 200}, "stream": True}
    async with session.post(f"{url}/generate", json=body) as response:
        await response.content.readline()  # the first event's line, then the client is gone


async def aborted(session: aiohttp.ClientSession, url: str, rid: str, delay: float) -> dict:
    """A long request aborted after `delay` seconds; the abort itself must answer within RESPONSIVE_S."""
    body = {"text": "Abort me", "rid": rid, "sampling_params": {**GREEDY, "max_new_tokens": 500}}
    task = asyncio.ensure_future(native(session, url, body))
    await asyncio.sleep(delay)
    began = time.monotonic()
    async with session.post(f"{url}/abort_request", json={"rid": rid}) as response:
        assert response.status == 200
    assert time.monotonic() - began < RESPONSIVE_S
    status, reply = await task
    assert status == 200
    return reply


async def client(i: int, session: aiohttp.ClientSession, url: str, expected: dict) -> None:
    """One of the load's clients; `i` picks what it does."""
    prompt = PROMPTS[i % len(PROMPTS)]
    kind = i % 9
    if kind == 0:
        status, reply = await native(session, url, {"text": prompt, "sampling_params": GREEDY})
        assert status == 200 and reply["text"] == expected["native"][prompt]
    elif kind in (1, 2):  # kind 2 reads slowly
        assert await native_stream(session, url, prompt, 0.05 * (kind == 2)) == expected["native"][prompt]
    elif kind in (3, 4):
        assert await completion(session, url, prompt, stream=kind == 4) == expected["openai"][prompt]
    elif kind == 5:
        await disconnect(session, url, prompt)
    elif kind == 6:
        reply = await aborted(session, url, f"abort-{i}", 0.05 * (i % 5))
        assert reply["meta_info"]["finish_reason"]["type"] in ("abort", "length")
    elif kind == 7:
        route, body = MALFORMED[i % len(MALFORMED)]
        async with session.post(f"{url}{route}", json=body) as response:
            assert 400 <= response.status < 500, (route, body, response.status)
    else:
        await long_prompt(i, session, url)


async def long_prompt(i: int, session: aiohttp.ClientSession, url: str) -> None:
    """900 prompt tokens, a few kB on the way to the scheduler: some dozens fill its socket."""
    body = {"input_ids": [(7 * j + i) % 500 + 10 for j in range(900)], "sampling_params": {"max_new_tokens": 4}}
    status, reply = await native(session, url, body)
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 4


async def references(session: aiohttp.ClientSession, url: str) -> dict:
    """Each prompt's greedy text on an idle server, per API."""
    expected: dict[str, dict[str, str]] = {"native": {}, "openai": {}}
    for prompt in PROMPTS:
        status, reply = await native(session, url, {"text": prompt, "sampling_params": GREEDY})
        assert status == 200
        expected["native"][prompt] = reply["text"]
        expected["openai"][prompt] = await completion(session, url, prompt, stream=False)
    return expected


async def freeze_for_a_while(session: aiohttp.ClientSession, url: str, server_pid: int) -> None:
    """Freeze the scheduler for two seconds while a burst of long prompts arrives, more than its socket holds
    (a server that wrote them from its event loop would stop answering until the scheduler reads again)."""
    await asyncio.sleep(0.5)
    with frozen_schedulers(server_pid):
        burst = asyncio.gather(*(long_prompt(CLIENTS + i, session, url) for i in range(100)))
        await asyncio.sleep(2.0)
    await burst


async def load_and_faults(url: str, server_pid: int) -> dict[str, float]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        expected = await references(session, url)
        probe = Probe(session, url)
        probing = asyncio.ensure_future(probe.run())
        try:
            await asyncio.gather(freeze_for_a_while(session, url, server_pid),
                                 *(client(i, session, url, expected) for i in range(CLIENTS)))
        finally:
            probe.running = False
            await probing
        return probe.slowest


def test_load_and_faults(tiny_server):
    slowest = asyncio.run(load_and_faults(tiny_server.url, tiny_server.process.pid))
    assert all(seconds < RESPONSIVE_S for seconds in slowest.values()), slowest
    assert_server_pool_free(tiny_server.url)


@pytest.fixture(scope="module")
def narrow_engine(tiny_model_dirs):
    """The tiny llama model behind an outbox of four requests."""
    with Engine(str(tiny_model_dirs["llama"]), **EXACT, max_total_tokens=TINY_POOL_TOKENS, torch_num_threads=2,
                max_pending_requests=4) as engine:
        yield engine


async def flood_a_frozen_scheduler(engine: Engine, prompt: list[int]) -> tuple[list, int, float]:
    """Submit requests until one is refused; the tasks of those accepted, the count, and the loop's longest stall."""
    params = {"max_new_tokens": 1, "temperature": 0}
    accepted: list[asyncio.Future] = []
    stall, last = 0.0, time.monotonic()
    for i in range(1000):  # a socket holds a few hundred kB: far fewer fill it and the outbox
        task = asyncio.ensure_future(engine.async_generate(input_ids=prompt + [i % 50 + 10], sampling_params=params,
                                                           rid=f"flood-{i}"))
        await asyncio.wait([task], timeout=0.01)  # time to submit its request, or be refused
        stall, last = max(stall, time.monotonic() - last), time.monotonic()
        if task.done() and isinstance(task.exception(), QueueFullError):
            return accepted, i, stall
        accepted.append(task)
    raise AssertionError("1,000 requests were accepted by an engine whose scheduler is frozen")


async def frozen_engine_run(engine: Engine) -> None:
    prompt = [(5 * j) % 400 + 20 for j in range(1000)]
    alone = (await engine.async_generate(input_ids=prompt + [10], sampling_params={"max_new_tokens": 1,
                                                                                   "temperature": 0}))
    os.kill(engine._process.pid, signal.SIGSTOP)
    try:
        accepted, count, stall = await flood_a_frozen_scheduler(engine, prompt)
        assert stall < RESPONSIVE_S and count > 4, (stall, count)
        assert engine.get_load()["pending"] == 4  # the outbox is full, the rest are in the socket
        engine.abort(f"flood-{count - 1}")  # still in the outbox: withdrawn, it ends now
        last = await asyncio.wait_for(accepted[-1], RESPONSIVE_S)
        assert last["meta_info"]["finish_reason"]["type"] == "abort" and last["output_ids"] == []
    finally:
        os.kill(engine._process.pid, signal.SIGCONT)
    results = await asyncio.gather(*accepted[:-1])
    assert [r["output_ids"] for r in results[:1]] == [alone["output_ids"]]
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)


def test_a_frozen_scheduler_never_blocks_the_caller(narrow_engine):
    asyncio.run(frozen_engine_run(narrow_engine))
    assert_pool_free(narrow_engine)
