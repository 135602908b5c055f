"""Online serving: one aiohttp load client against furcate's server and llama.cpp's, beside furcate's offline Engine.

Every system gets the same seeded workload, the same weights (the embedded SmolLM2-135M-Instruct: furcate runs the
GGUF's weights dequantized to float32, llama.cpp runs the GGUF itself) and the same thread count:

  furcate-server   `python -m furcate serve` via ServerProcess, driven through one of its protocols (--furcate-api):
                   OpenAI `/v1/completions` (stream, stream_options.include_usage) by default, or native `/generate`
  furcate-offline  furcate.Engine.generate on the whole workload in one call: the throughput ceiling
  llama.cpp        llama-cpp-python's server (`python -m llama_cpp.server`), `/v1/completions` streaming

Workloads: `random` (random-word prompts of a sampled length, fixed output length) and `shared_prefix` (G groups,
each a long shared prefix plus short distinct suffixes, interleaved so neighbours in arrival order share nothing).
Every request generates exactly its output length (EOS is ignored or masked) and every server request streams.
Arrival modes: a fixed number of requests in flight (`--concurrency`; `all` sends the whole workload at once, the
batch the offline Engine gets, so its ratio to offline is the server's own overhead) and Poisson arrivals
(`--request-rate`).

Metrics per run: requests/s, output tokens/s (tokens as the server counts them), time to first token, inter-token
latency (gaps between streamed chunks), time per output token, end-to-end latency, and the ratio of output tok/s
to the offline Engine's on the same workload. Writes benchmarks/results/serving.{json,md}.

    python -m benchmarks.serving [--quick] [--systems furcate-offline,furcate-server,llama.cpp]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import glob
import json
import math
import os
import pathlib
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

RESULTS = pathlib.Path(__file__).parent / "results"
WORDS = ("river", "stone", "garden", "signal", "market", "ladder", "window", "copper", "silent", "orange", "engine",
         "winter", "harbor", "pencil", "cloud", "forest", "matter", "bridge", "candle", "number", "planet", "velvet",
         "thunder", "basket", "mirror", "shadow", "spring", "anchor", "meadow", "lantern", "rocket", "canyon",
         "violin", "marble", "desert", "island", "feather", "saddle", "crystal", "tunnel")
SYSTEMS = ("furcate-offline", "furcate-server", "llama.cpp")
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600
LLAMA_LOG = pathlib.Path("/tmp/furcate_serving_llama_server.log")
# SmolLM2's end-of-generation tokens (<|endoftext|>, <|im_end|>); llama.cpp stops on either, so both are masked.
EOG_TOKEN_IDS = (0, 2)


# -- workloads ------------------------------------------------------------------------------------------------

@dataclass
class Request:
    prompt: str
    prompt_len: int  # tokens of the prompt by the model's tokenizer (the servers' own counts are checked too)
    output_len: int


@dataclass
class Workload:
    name: str
    description: str
    requests: list[Request]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)


def random_text(tokenizer, rng: random.Random, n_tokens: int) -> list[int]:
    """Token ids of random words, cut to exactly n_tokens."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(64)))
    return ids[:n_tokens]


def make_request(tokenizer, ids: list[int], output_len: int) -> Request:
    # Servers get text (what clients send); its length is re-measured because decode/encode may not round-trip.
    text = tokenizer.decode(ids)
    return Request(text, len(tokenizer.encode(text)), output_len)


def random_workload(tokenizer, num: int, input_len: int, range_ratio: float, output_len: int, seed: int) -> Workload:
    """Prompt lengths uniform in [input_len * range_ratio, input_len] (range_ratio 1: fixed), fixed output length."""
    rng = random.Random(seed)
    low = max(1, int(input_len * range_ratio))
    requests = [make_request(tokenizer, random_text(tokenizer, rng, rng.randint(low, input_len)), output_len)
                for _ in range(num)]
    return Workload("random", f"{num} requests, input {low}-{input_len} tokens, output {output_len}", requests)


def shared_prefix_workload(tokenizer, groups: int, per_group: int, prefix_len: int, suffix_len: int,
                           output_len: int, seed: int) -> Workload:
    rng = random.Random(seed + 1)
    prefixes = [random_text(tokenizer, rng, prefix_len) for _ in range(groups)]
    # Interleaved (group 0, group 1, ..., group 0, ...): the server, not the arrival order, must find the sharing.
    requests = [make_request(tokenizer, prefixes[g] + random_text(tokenizer, rng, suffix_len), output_len)
                for _ in range(per_group) for g in range(groups)]
    return Workload("shared_prefix", f"{groups} groups x {per_group} requests, prefix {prefix_len} + suffix "
                    f"{suffix_len} tokens, output {output_len}", requests)


# -- arrival modes --------------------------------------------------------------------------------------------

@dataclass
class Mode:
    name: str
    concurrency: int | None = None  # requests in flight (None: all of them), or
    request_rate: float | None = None  # Poisson arrivals per second

    def arrival_offsets(self, n: int, seed: int) -> list[float]:
        """Seconds after the start at which each request may be sent; the same for every system."""
        if self.request_rate is None:
            return [0.0] * n
        rng, t, offsets = random.Random(seed), 0.0, []
        for _ in range(n):
            offsets.append(t)
            t += rng.expovariate(self.request_rate)
        return offsets


# -- CPU accounting -------------------------------------------------------------------------------------------

def machine_busy_seconds() -> float:
    """CPU seconds used since boot by all processes plus hypervisor steal (/proc/stat: user..steal, not guest)."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system time of a process and of its reaped children (a finished helper's time stays counted)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """pid and every process below it: servers spawn schedulers, which are ours too."""
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        for path in glob.glob(f"/proc/{current}/task/*/children"):
            try:
                stack += [int(child) for child in pathlib.Path(path).read_text().split()]
            except OSError:
                pass
    return found


class CpuMeter:
    """CPU time that processes outside this benchmark's tree used since creation.

    On a shared 2-core box another engineer's test run silently slows whichever system is running; with every
    core busy with our threads, even 5% foreign use makes threads wait at each parallel region for a peer.
    """

    def __init__(self) -> None:
        self.pids = descendants(os.getpid())
        self.started = self._sample()
        self.wall_started = time.perf_counter()

    def _sample(self) -> tuple[float, float]:
        return machine_busy_seconds(), sum(process_cpu_seconds(pid) for pid in self.pids)

    def foreign_share(self) -> float:
        """Foreign CPU seconds over the available CPU seconds (wall x cores) since creation."""
        busy, ours = self._sample()
        foreign = max(0.0, (busy - self.started[0]) - (ours - self.started[1]))
        return foreign / ((time.perf_counter() - self.wall_started) * (os.cpu_count() or 1))


def wait_until_idle(limit_s: float, threshold: float = 0.05, sample_s: float = 3.0) -> float:
    """Foreign CPU share over sample_s, polled until below threshold or limit_s passed; returns the last sample.

    Only processes outside our tree count: an idle server of ours may poll, and must not look like a stranger.
    """
    deadline = time.monotonic() + limit_s
    announced = False
    while True:
        meter = CpuMeter()
        time.sleep(sample_s)
        share = meter.foreign_share()
        if share < threshold or time.monotonic() >= deadline:
            return share
        if not announced:
            print(f"    other processes use {share:.0%} of the CPU; waiting up to {limit_s:.0f}s for them", flush=True)
            announced = True


class Watchdog:
    """Trips once other processes take over `limit` of the CPU within one window of window_s seconds.

    A torch run sharing its cores slows several times over (threads wait at every parallel region for a
    descheduled peer), so an attempt that will be discarded anyway is better stopped than waited out.
    """

    def __init__(self, limit: float | None, window_s: float = 3.0) -> None:
        self.limit, self.window_s = limit, window_s
        self.tripped_share: float | None = None
        self._meter, self._window_started = CpuMeter(), time.monotonic()

    def tripped(self) -> bool:
        if self.limit is None or self.tripped_share is not None:
            return self.tripped_share is not None
        if time.monotonic() - self._window_started >= self.window_s:
            share = self._meter.foreign_share()
            if share > self.limit:
                self.tripped_share = share
                return True
            self._meter, self._window_started = CpuMeter(), time.monotonic()
        return False


class Disturbed(Exception):
    """A run stopped early by its watchdog."""


@dataclass
class Policy:
    """When a timed run may start, when it is stopped early and when it is run again."""

    wait_idle_s: float  # wait this long at most for other processes to go quiet before each run
    retries: int  # extra attempts for a run during which other processes took over 5% of the CPU
    abort_share: float = 0.25  # stop an attempt (not the last) once a window's foreign share passes this
    waited_s: float = 0.0  # total time spent waiting for other processes (reported, not measured)


def steady(policy: Policy, label: str, run_once: Callable[[Watchdog], dict]) -> dict:
    """run_once's row from its first undisturbed attempt (or its last), with the discarded attempts noted."""
    discarded: list[float] = []
    while True:
        waiting = time.perf_counter()
        idle_share = wait_until_idle(policy.wait_idle_s)
        policy.waited_s += time.perf_counter() - waiting
        last = len(discarded) >= policy.retries
        watchdog = Watchdog(None if last else policy.abort_share)
        try:
            row = run_once(watchdog) | {"foreign_cpu_share_before": idle_share}
        except Disturbed:
            row = {"disturbed": True, "foreign_cpu_share": watchdog.tripped_share}
        if not row["disturbed"] or last:
            return row | {"discarded_attempts_foreign_cpu": discarded}
        discarded.append(row["foreign_cpu_share"])
        print(f"  {label}: other processes took {row['foreign_cpu_share']:.0%} of the CPU; running it again",
              flush=True)


def loadavg() -> str:
    return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])


# -- the client -----------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One streamed request, times in seconds from its send."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried new text
    completion_tokens: int | None = None
    tokens_source: str = ""  # where completion_tokens came from: the server's usage/meta, or its finish reason
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens served from the server's prefix cache, where it says
    finish_reason: str | None = None
    text: str = ""


class Protocol:
    """How one API asks for a streamed completion and reports its tokens."""

    route = ""

    def payload(self, req: Request) -> dict:
        raise NotImplementedError

    def absorb(self, data: dict, out: Outcome) -> str:
        """Fold one SSE event into out; returns the new text it carried."""
        raise NotImplementedError

    def finish(self, req: Request, out: Outcome) -> None:
        """Settle the token count once the stream ended."""


class NativeProtocol(Protocol):
    """furcate's /generate: cumulative text, cumulative meta_info.completion_tokens."""

    route = "/generate"

    def payload(self, req: Request) -> dict:
        return {"text": req.prompt, "stream": True,
                "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}}

    def absorb(self, data: dict, out: Outcome) -> str:
        new = data.get("text", "")[len(out.text):]
        out.text = data.get("text", out.text)
        meta = data.get("meta_info", {})
        if "completion_tokens" in meta:
            out.completion_tokens, out.tokens_source = meta["completion_tokens"], "meta_info"
        out.prompt_tokens = meta.get("prompt_tokens", out.prompt_tokens)
        out.cached_tokens = meta.get("cached_tokens", out.cached_tokens)
        reason = meta.get("finish_reason")
        out.finish_reason = reason.get("type") if isinstance(reason, dict) else reason or out.finish_reason
        return new


class OpenAIProtocol(Protocol):
    """/v1/completions streaming: text deltas, usage in a last chunk when the server honours include_usage."""

    route = "/v1/completions"

    def __init__(self, model: str, extra: dict | None = None) -> None:
        self.model = model
        self.extra = extra or {}

    def payload(self, req: Request) -> dict:
        return {"model": self.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, **self.extra}

    def absorb(self, data: dict, out: Outcome) -> str:
        if data.get("usage"):
            out.completion_tokens = data["usage"].get("completion_tokens")
            out.prompt_tokens = data["usage"].get("prompt_tokens")
            out.cached_tokens = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            out.tokens_source = "usage"
        choices = data.get("choices") or [{}]
        out.finish_reason = choices[0].get("finish_reason") or out.finish_reason
        new = choices[0].get("text") or ""
        out.text += new
        return new

    def finish(self, req: Request, out: Outcome) -> None:
        # llama-cpp-python's stream has no usage chunk; a finish reason of "length" is still the server saying it
        # produced exactly max_tokens tokens.
        if out.completion_tokens is None and out.finish_reason == "length":
            out.completion_tokens, out.tokens_source = req.output_len, "finish_reason=length"


async def stream_one(session: aiohttp.ClientSession, url: str, protocol: Protocol, req: Request) -> Outcome:
    out = Outcome()
    started = time.perf_counter()
    try:
        async with session.post(url + protocol.route, json=protocol.payload(req)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue  # blank separators and ": ping" comments
                body = line[5:].strip()
                if body == "[DONE]":
                    break
                data = json.loads(body)
                if "error" in data:
                    out.error = json.dumps(data["error"])[:300]
                    return out
                if protocol.absorb(data, out):
                    now = time.perf_counter() - started
                    out.ttft = now if out.ttft is None else out.ttft
                    out.chunk_times.append(now)
        out.e2e = time.perf_counter() - started
        protocol.finish(req, out)
        out.ok = out.ttft is not None
        if not out.ok:
            out.error = "stream ended without text"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def drive(url: str, protocol: Protocol, requests: list[Request], mode: Mode, seed: int,
                watchdog: Watchdog | None = None) -> tuple[list[Outcome], float]:
    """Send every request under the arrival mode; returns outcomes (request order) and the wall time.

    Raises Disturbed (having cancelled every request: the server sees the disconnects) if the watchdog trips."""
    offsets = mode.arrival_offsets(len(requests), seed)
    # The concurrency cap is ours; the connector must not add one of its own (aiohttp's default is 100).
    gate = asyncio.Semaphore(mode.concurrency or len(requests))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        started = time.perf_counter()

        async def one(req: Request, offset: float) -> Outcome:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            async with gate:
                return await stream_one(session, url, protocol, req)

        run = asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        while not run.done():
            await asyncio.wait([run], timeout=1.0)
            if not run.done() and watchdog is not None and watchdog.tripped():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                raise Disturbed()
        return list(run.result()), time.perf_counter() - started


# -- metrics --------------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(workload: Workload, outcomes: list[Outcome], wall: float, foreign_share: float) -> dict:
    done = [o for o in outcomes if o.ok]
    tokens = [o.completion_tokens for o in done if o.completion_tokens is not None]
    itl = [b - a for o in done for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    tpot = [(o.e2e - o.ttft) / (o.completion_tokens - 1) for o in done
            if o.completion_tokens and o.completion_tokens > 1]
    chunks = sum(len(o.chunk_times) for o in done)
    errors = sorted({o.error for o in outcomes if o.error})
    short = sum(1 for o, r in zip(outcomes, workload.requests) if o.ok and o.completion_tokens != r.output_len)
    return {
        "completed": len(done), "failed": len(outcomes) - len(done), "errors": errors[:5],
        "wall_seconds": wall, "requests_per_s": len(done) / wall, "output_tok_s": sum(tokens) / wall,
        "output_tokens": sum(tokens), "uncounted_requests": len(done) - len(tokens),
        "requests_not_at_output_len": short,
        "tokens_source": sorted({o.tokens_source for o in done}),
        "server_prompt_tokens": sum(o.prompt_tokens for o in done) if all(o.prompt_tokens for o in done) else None,
        "cached_prompt_tokens": (sum(o.cached_tokens for o in done)
                                 if done and all(o.cached_tokens is not None for o in done) else None),
        "ttft_p50_ms": ms(percentile([o.ttft for o in done], 50)),
        "ttft_p99_ms": ms(percentile([o.ttft for o in done], 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
        "tpot_mean_ms": ms(sum(tpot) / len(tpot) if tpot else None),
        "e2e_p50_s": percentile([o.e2e for o in done], 50), "e2e_p99_s": percentile([o.e2e for o in done], 99),
        "tokens_per_chunk": sum(tokens) / chunks if chunks else None,
        "foreign_cpu_share": foreign_share, "disturbed": foreign_share > 0.05,
        "sample_output": done[0].text[:120] if done else None,
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


# -- systems --------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def post(url: str, payload: dict | None = None) -> tuple[int, str]:
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
                session.post(url, json=payload or {}) as resp):
        return resp.status, await resp.text()


class HttpSystem:
    """A started server: where it listens, how it is asked, and how its prefix state is reset between runs."""

    def __init__(self, name: str, url: str, protocol: Protocol, stop) -> None:
        self.name, self.url, self.protocol, self._stop = name, url, protocol, stop

    async def reset(self) -> None:
        raise NotImplementedError

    async def count_prompt_tokens(self, workload: Workload) -> int | None:
        """The server's own count of the workload's prompt tokens, for servers whose stream does not report it."""
        return None

    def stop(self) -> None:
        self._stop()


class FurcateServer(HttpSystem):
    async def reset(self) -> None:
        # A run must not find the previous run's prompts (same workload, other mode) in the radix cache.
        for _ in range(60):  # after a stopped attempt the server may still be aborting its requests
            status, body = await post(self.url + "/flush_cache")
            if status == 200:
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"POST /flush_cache answered {status}: {body[:200]}")


class LlamaServer(HttpSystem):
    async def reset(self) -> None:
        # llama-cpp-python keeps the last prompt's KV and reuses its common prefix with the next prompt: an
        # unrelated request makes the next run start from nothing, as furcate's does after /flush_cache.
        await drive(self.url, self.protocol, [Request(" Unrelated warm-up text.", 5, 1)], Mode("reset", 1), 0)

    async def count_prompt_tokens(self, workload: Workload) -> int | None:
        total = 0
        for req in workload.requests:
            status, body = await post(self.url + "/extras/tokenize/count", {"input": req.prompt})
            if status != 200:
                return None
            total += json.loads(body)["count"]
        return total


def start_furcate_server(model_dir: str, threads: int, engine_args: dict, api: str) -> FurcateServer:
    from furcate.runtime.server.server_process import ServerProcess

    server = ServerProcess(model_dir, {"torch_num_threads": threads, **engine_args}, "127.0.0.1", port=0)
    url = server.url.rstrip("/")
    protocol = NativeProtocol() if api == "native" else OpenAIProtocol(served_model(url), {"ignore_eos": True})
    return FurcateServer(f"furcate-server ({protocol.route})", url, protocol, server.stop)


def llama_settings(gguf: str, threads: int) -> dict:
    """The server settings a llama-cpp-python user gets with our flags (everything else at its default)."""
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    model = ModelSettings(model=gguf, n_threads=threads, n_threads_batch=threads)
    server = ServerSettings(interrupt_requests=False)
    keys = ("n_ctx", "n_batch", "n_ubatch", "n_threads", "n_threads_batch", "cache", "flash_attn", "type_k",
            "type_v", "offload_kqv", "n_gpu_layers")
    return {**{k: getattr(model, k) for k in keys if hasattr(model, k)},
            "interrupt_requests": server.interrupt_requests,
            "default_n_threads": ModelSettings(model=gguf).n_threads,
            "default_interrupt_requests": ServerSettings().interrupt_requests,
            "requests": "serialized: one global lock in llama_cpp.server.app, one sequence at a time"}


def start_llama_server(gguf: str, threads: int) -> LlamaServer:
    port = free_port()
    # interrupt_requests defaults to True, which ends a running stream early as soon as another request waits:
    # under any concurrency most outputs would be cut short, so it is turned off (the requests still queue).
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--interrupt_requests", "False"]
    with open(LLAMA_LOG, "w") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/v1/models", process)
    except BaseException:
        stop()
        raise
    # Greedy, no repetition penalty (its default is 1.1; furcate applies none), and the end-of-generation tokens
    # masked so every request produces exactly max_tokens tokens, as ignore_eos does on furcate.
    extra = {"repeat_penalty": 1.0, "logit_bias": {str(t): -100.0 for t in EOG_TOKEN_IDS}}
    return LlamaServer("llama.cpp server", url, OpenAIProtocol(served_model(url), extra), stop)


def served_model(url: str) -> str:
    """The model id the server lists first in /v1/models (what an OpenAI client must send)."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def wait_http_ready(url: str, process: subprocess.Popen) -> None:
    import urllib.request

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode}; see {LLAMA_LOG}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {STARTUP_TIMEOUT_S}s")


def warm_up(system: HttpSystem, workload: Workload) -> None:
    """Two untimed requests (first forwards of each shape, lazy imports), on text the timed runs never send."""
    reqs = [Request("Warm-up." + r.prompt[: len(r.prompt) // 2], 0, 8) for r in workload.requests[:2]]
    outcomes, _ = asyncio.run(drive(system.url, system.protocol, reqs, Mode("warm-up", 2), 0))
    bad = [o.error for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError(f"{system.name} failed its warm-up: {bad[0]}")


def http_once(system: HttpSystem, workload: Workload, mode: Mode, seed: int, watchdog: Watchdog) -> dict:
    asyncio.run(system.reset())
    meter = CpuMeter()
    outcomes, wall = asyncio.run(drive(system.url, system.protocol, workload.requests, mode, seed, watchdog))
    return summarize(workload, outcomes, wall, meter.foreign_share())


def run_http_system(system: HttpSystem, workloads: list[Workload], modes: list[Mode], seed: int,
                    policy: Policy) -> dict:
    results: dict = {}
    for workload in workloads:
        warm_up(system, workload)
        for mode in modes:
            once = functools.partial(http_once, system, workload, mode, seed)
            row = steady(policy, f"{system.name} {workload.name} {mode.name}", once)
            if row["server_prompt_tokens"] is None:  # untimed: after the run
                row["server_prompt_tokens"] = asyncio.run(system.count_prompt_tokens(workload))
            results.setdefault(workload.name, {})[mode.name] = row
            print(f"  {system.name:<30} {workload.name:<14} {mode.name:<12} " + brief(row), flush=True)
    return results


def offline_once(engine, workload: Workload, watchdog: Watchdog) -> dict:
    # The warm-up (or the previous attempt) must not serve the timed prompts from the prefix cache.
    assert engine.flush_cache(), "furcate refused to flush its prefix cache"
    params = [{"max_new_tokens": r.output_len, "temperature": 0.0, "ignore_eos": True} for r in workload.requests]
    rid, done = f"serving-bench-{uuid.uuid4().hex}", threading.Event()

    def watch() -> None:
        while not done.wait(1.0):
            if watchdog.tripped():  # a list's requests are named f"{rid}-{index}-{sample}"
                for index in range(len(workload.requests)):
                    engine.abort(f"{rid}-{index}-0")
                return

    watcher = threading.Thread(target=watch, daemon=True)
    before = engine.get_stats()
    meter, started = CpuMeter(), time.perf_counter()
    watcher.start()
    try:
        outputs = engine.generate([r.prompt for r in workload.requests], params, rid=rid)
    except Exception:
        if watchdog.tripped_share is None:
            raise
    finally:
        done.set()
        watcher.join()
    if watchdog.tripped_share is not None:
        raise Disturbed()
    wall, foreign = time.perf_counter() - started, meter.foreign_share()
    cached = engine.get_stats()["cached_tokens_total"] - before["cached_tokens_total"]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {"completed": len(outputs), "failed": 0, "wall_seconds": wall, "requests_per_s": len(outputs) / wall,
            "output_tok_s": tokens / wall, "output_tokens": tokens, "tokens_source": ["meta_info"],
            "server_prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outputs),
            "cached_prompt_tokens": cached,
            "requests_not_at_output_len": sum(o["meta_info"]["completion_tokens"] != r.output_len
                                              for o, r in zip(outputs, workload.requests)),
            "foreign_cpu_share": foreign, "disturbed": foreign > 0.05, "sample_output": outputs[0]["text"][:120]}


def run_offline(model_dir: str, threads: int, engine_args: dict, workloads: list[Workload], policy: Policy,
                label: str = "batch") -> dict:
    """The whole workload in one Engine.generate call: no HTTP, no streaming, no arrival gaps."""
    from furcate import Engine

    results: dict = {}
    with Engine(model_dir, torch_num_threads=threads, **engine_args) as engine:
        for workload in workloads:
            engine.generate([r.prompt for r in workload.requests[:2]], {"max_new_tokens": 8, "temperature": 0.0})
            row = steady(policy, f"furcate-offline {workload.name}", functools.partial(offline_once, engine, workload))
            results[workload.name] = {label: row}
            print(f"  {'furcate-offline':<30} {workload.name:<14} {label:<12} " + brief(row), flush=True)
    return results


def brief(row: dict) -> str:
    parts = [f"{row['requests_per_s']:.2f} req/s", f"{row['output_tok_s']:.1f} tok/s"]
    if row.get("ttft_p50_ms") is not None:
        parts += [f"TTFT p50 {row['ttft_p50_ms']:.0f} ms", f"ITL p50 {row['itl_p50_ms']:.1f} ms"]
    if row.get("failed"):
        parts.append(f"{row['failed']} FAILED {row.get('errors')}")
    if row.get("requests_not_at_output_len"):
        parts.append(f"{row['requests_not_at_output_len']} not at their output length")
    return ", ".join(parts) + f", foreign CPU {row['foreign_cpu_share']:.1%}"


# -- reporting ------------------------------------------------------------------------------------------------

def add_ratios(results: dict) -> None:
    """Each run's output tok/s over the offline Engine's on the same workload (the mean of its runs)."""
    offline = results.get("furcate-offline", {})
    for system in results.values():
        for workload, runs in system.items():
            ceilings = [row["output_tok_s"] for row in offline.get(workload, {}).values()]
            ceiling = sum(ceilings) / len(ceilings) if ceilings else None
            for row in runs.values():
                row["ratio_to_offline"] = row["output_tok_s"] / ceiling if ceiling else None


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else spec.format(value)


COLUMNS = [("req/s", "requests_per_s", "{:.2f}"), ("out tok/s", "output_tok_s", "{:.1f}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
           ("ITL p50 ms", "itl_p50_ms", "{:.1f}"), ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
           ("TPOT ms", "tpot_mean_ms", "{:.1f}"), ("E2E p50 s", "e2e_p50_s", "{:.2f}"),
           ("E2E p99 s", "e2e_p99_s", "{:.2f}"), ("vs offline", "ratio_to_offline", "{:.2f}"),
           ("cache hit", "cache_hit_rate", "{:.0%}"), ("failed", "failed", "{}"),
           ("foreign CPU", "foreign_cpu_share", "{:.1%}")]


def table(workload: str, results: dict) -> list[str]:
    lines = ["| system | arrivals | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for system, runs in results.items():
        for mode, row in runs.get(workload, {}).items():
            cached, prompt = row.get("cached_prompt_tokens"), row.get("server_prompt_tokens")
            row = row | {"cache_hit_rate": cached / prompt if cached is not None and prompt else None}
            cells = [fmt(row.get(key), spec) for _, key, spec in COLUMNS]
            lines.append(f"| {system} | {mode} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(path: pathlib.Path, report: dict) -> None:
    cfg, results = report["config"], report["results"]
    busy = [f"{s} / {w} / {m}" for s, ws in results.items() for w, ms_ in ws.items() for m, r in ms_.items()
            if r.get("disturbed")]
    lines = [f"# Serving benchmark ({report['date']})", "",
             f"SmolLM2-135M-Instruct on CPU, {cfg['threads']} threads for every system, greedy, every request "
             "generates exactly its output length (furcate: ignore_eos; llama.cpp: EOS tokens masked by "
             "logit_bias). Server requests all stream; one aiohttp client drives both servers. Tokens are the "
             "servers' own counts (" + ", ".join(sorted({s for ws in results.values() for ms_ in ws.values()
                                                         for r in ms_.values() for s in r.get('tokens_source', [])}))
             + "). ITL is the gap between streamed chunks with new text; TPOT = (E2E - TTFT) / (tokens - 1); "
             "'vs offline' = out tok/s over furcate's offline Engine (the whole workload in one generate call) on "
             "the same workload, the mean of its runs before and after the server's. conc=all sends every "
             "request at once, the batch the offline Engine gets, so "
             "its 'vs offline' is the server's own overhead; with fewer in flight or Poisson arrivals, "
             "throughput is bounded by the offered load, not by the server. 'cache hit' = prompt tokens the "
             "server reports as served from its prefix cache (llama-cpp-python reports none).", "",
             (f"- furcate server: `{report['furcate_api']}`, engine args `{json.dumps(report['engine_args'])}`, "
              f"weights {report['precision']['furcate']}"),
             (f"- llama.cpp: llama-cpp-python {report['llama_cpp_version']}, GGUF {report['precision']['gguf']}; "
              f"settings `{json.dumps(report['llama_settings'])}`. What a llama-cpp-python user gets: requests "
              "are served one at a time (the others queue, so TTFT includes the queue); n_threads defaults to "
              f"cpu_count // 2 ({(report['llama_settings'] or {}).get('default_n_threads')} here; set to the same "
              "count as furcate); interrupt_requests defaults to True, "
              "which ends a running stream as soon as another request arrives (turned off here, or most "
              "concurrent outputs are cut short); the only prefix reuse is the previous request's KV (the RAM "
              "cache is opt-in, --cache). furcate runs the same weights dequantized to float32; llama.cpp runs "
              "the Q4_1 blocks, about a sixth of the weight bytes to read per decode step (its shorter ITL)."),
             f"- machine: {os.cpu_count()} cores; load average before {report['loadavg_before']}, after "
             f"{report['loadavg_after']}; every run waited for other processes to go quiet (up to "
             f"{cfg['wait_idle']:.0f} s) and was stopped and run again (up to {cfg['retries']}x) when they took "
             "over 5% of the CPU during it; "
             + (f"runs still over 5% foreign CPU (treat as rough): {', '.join(busy)}" if busy
                else "no reported run had over 5% foreign CPU")
             + f"; total {report['total_seconds']:.0f} s, of which {report.get('waited_seconds', 0):.0f} s "
             "waiting for other processes", ""]
    retried = [f"{s} / {w} / {m} ({len(r['discarded_attempts_foreign_cpu'])}x)" for s, ws in results.items()
               for w, ms_ in ws.items() for m, r in ms_.items() if r.get("discarded_attempts_foreign_cpu")]
    if retried:
        lines += [f"Runs measured again because other processes took over 5% of the CPU: {', '.join(retried)}.", ""]
    for workload in report["workloads"]:
        lines += [f"## {workload['name']}: {workload['description']}", "",
                  f"{workload['prompt_tokens']} prompt tokens, {workload['output_tokens']} output tokens.", "",
                  *table(workload["name"], results), ""]
    lines += [f"Command: `{report['command']}`", ""]
    path.write_text("\n".join(lines))


def gguf_precision(gguf: str) -> str:
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors)
    return ", ".join(f"{n} tensors {kind}" for kind, n in counts.most_common())


# -- main -----------------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (few, short requests)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--workloads", default="random,shared_prefix")
    parser.add_argument("--furcate-api", choices=("openai", "native"), default="openai")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-range-ratio", type=float, default=0.25)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompts-per-group", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--prefix-output-len", type=int, default=32)
    parser.add_argument("--concurrency", default="all,8",
                        help="comma list of requests in flight, one run each; all = the whole workload at once")
    parser.add_argument("--request-rate", default="1", help="comma list of Poisson arrival rates (requests/s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for furcate, n_threads for llama.cpp")
    parser.add_argument("--engine-args", type=json.loads, default={}, help="extra furcate engine arguments (JSON)")
    parser.add_argument("--wait-idle", type=float, default=300.0,
                        help="before each timed run, wait up to this many seconds for other processes to go quiet")
    parser.add_argument("--retries", type=int, default=3,
                        help="run a measurement again (at most this often) when other processes took over 5%% of "
                             "the CPU during it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path; the .md goes beside it")
    parser.add_argument("--report-from", default=None, help="only rewrite the .md beside this results JSON")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.random_input_len, args.random_output_len = 6, 64, 16
        args.groups, args.prompts_per_group, args.prefix_len, args.suffix_len = 2, 3, 128, 16
        args.prefix_output_len, args.concurrency, args.request_rate = 16, "all,2", "4"
    args.output = args.output or str(RESULTS / ("serving_quick.json" if args.quick else "serving.json"))
    return args


def build_workloads(args: argparse.Namespace, tokenizer) -> list[Workload]:
    builders = {
        "random": lambda: random_workload(tokenizer, args.num_prompts, args.random_input_len,
                                          args.random_range_ratio, args.random_output_len, args.seed),
        "shared_prefix": lambda: shared_prefix_workload(tokenizer, args.groups, args.prompts_per_group,
                                                        args.prefix_len, args.suffix_len, args.prefix_output_len,
                                                        args.seed),
    }
    return [builders[name]() for name in args.workloads.split(",") if name]


def build_modes(concurrency: str, rates: str) -> list[Mode]:
    modes = [Mode(f"conc={c}", concurrency=None if c == "all" else int(c)) for c in concurrency.split(",") if c]
    return modes + [Mode(f"poisson={float(r):g}/s", request_rate=float(r)) for r in rates.split(",") if r]


def run_systems(args: argparse.Namespace, systems: list[str], model_dir: str, gguf: str,
                workloads: list[Workload], modes: list[Mode]) -> tuple[dict, float]:
    """Results per system, and the seconds spent waiting for an idle machine."""
    policy = Policy(args.wait_idle, args.retries)
    # The offline ceiling runs on both sides of the server's runs: the same workload drifts by 10-15% over
    # minutes on this shared machine, which would otherwise show up as server overhead (or as a ratio over 1).
    if "furcate-offline" in systems and "furcate-server" in systems:
        systems = ["furcate-offline", "furcate-server", "furcate-offline (again)",
                   *(s for s in systems if s not in ("furcate-offline", "furcate-server"))]
    results: dict = {}
    for name in systems:
        print(f"{name}:", flush=True)
        if name.startswith("furcate-offline"):
            label = "batch (again)" if "again" in name else "batch"
            rows = run_offline(model_dir, args.threads, args.engine_args, workloads, policy, label)
            for workload, runs in rows.items():
                results.setdefault("furcate-offline", {}).setdefault(workload, {}).update(runs)
            continue
        if name == "furcate-server":
            system: HttpSystem = start_furcate_server(model_dir, args.threads, args.engine_args, args.furcate_api)
        else:
            system = start_llama_server(gguf, args.threads)
        try:
            results[name] = run_http_system(system, workloads, modes, args.seed, policy)
        finally:
            system.stop()
    return results, policy.waited_s


def main() -> None:
    args = parse_args()
    if args.report_from:  # rewrite the markdown of an earlier run (e.g. after a change to its layout)
        source = pathlib.Path(args.report_from)
        write_markdown(source.with_suffix(".md"), json.loads(source.read_text()))
        print(f"wrote {source.with_suffix('.md')}")
        return
    from transformers import AutoTokenizer

    from furcate.runtime.model.weights.checkpoint import resolve_model_path
    from furcate.runtime.model.weights.default_model import find_default_gguf

    model_dir, gguf = resolve_model_path("default"), str(find_default_gguf())
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    workloads = build_workloads(args, AutoTokenizer.from_pretrained(model_dir))
    modes = build_modes(args.concurrency, args.request_rate)

    idle_share = wait_until_idle(0.0)
    report: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "config": vars(args),
                    "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
                    "loadavg_before": loadavg(), "idle_check_share": idle_share}
    print(f"load {report['loadavg_before']}, CPU in use {idle_share:.0%}; "
          + "; ".join(f"{w.name}: {w.description}" for w in workloads), flush=True)
    started = time.perf_counter()
    results, waited = run_systems(args, systems, model_dir, gguf, workloads, modes)
    add_ratios(results)

    llama = "llama.cpp" in systems
    report |= {
        "loadavg_after": loadavg(), "total_seconds": time.perf_counter() - started, "waited_seconds": waited,
        "furcate_api": ("/generate" if args.furcate_api == "native" else "/v1/completions") + " (streaming)",
        "engine_args": {"torch_num_threads": args.threads, **args.engine_args},
        "llama_cpp_version": __import__("llama_cpp").__version__ if llama else None,
        "llama_settings": llama_settings(gguf, args.threads) if llama else None,
        "precision": {"gguf": gguf_precision(gguf), "furcate": "float32 (the GGUF dequantized; dtype auto)"},
        "workloads": [{"name": w.name, "description": w.description, "prompt_tokens": w.prompt_tokens,
                       "output_tokens": w.output_tokens} for w in workloads],
        "results": results,
    }
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(out.with_suffix(".md"), report)
    print("\n".join(line for w in report["workloads"] for line in ["", w["name"], *table(w["name"], results)]))
    print(f"load before {report['loadavg_before']}, after {report['loadavg_after']}; "
          f"total {report['total_seconds']:.0f}s; wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
