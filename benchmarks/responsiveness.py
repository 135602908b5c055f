"""How a busy server answers: /health, /get_load and a control call under a heavy-prompt load, and an abort of all.

The load: `--clients` concurrent requests (12 by default), each a distinct prompt of `--prompt-tokens` (7,000) token
ids and 64 new tokens, against `furcate serve` on the default model. While it runs, a prober asks /health and
/get_load every 50 ms and /get_server_info (a control call the scheduler answers) every 250 ms, each waiting for
its answer before the next. `--abort-after` seconds in, one `/abort_request {"abort_all": true}`; the figures are
how long that call took to answer and how long until every request had returned.

Side by side: `--checkouts NAME=DIR ...` runs the same load against the server of each furcate checkout (its
directory on PYTHONPATH as the `furcate` package, e.g. a link `DIR/furcate -> checkout`), one after the other, so a
change is measured against the code before it in one run. Writes
benchmarks/results/responsiveness_{clients}x{prompt tokens}.{json,md}.

    python -m benchmarks.responsiveness [--checkouts before=/path/a after=/path/b] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import time

import aiohttp
import torch

from furcate.runtime.server.server_process import ServerProcess

from .peers_report import cpu_flags

RESULTS = pathlib.Path(__file__).parent / "results"
PROBES = {"/health": 0.05, "/get_load": 0.05, "/get_server_info": 0.25}  # route: pause between asks


class Prober:
    """Asks one route again and again, each time after the last answer, and keeps every latency."""

    def __init__(self, session: aiohttp.ClientSession, url: str, route: str, pause: float) -> None:
        self.session, self.url, self.route, self.pause = session, url, route, pause
        self.latencies: list[float] = []
        self.running = True

    async def run(self) -> None:
        while self.running:
            began = time.monotonic()
            async with self.session.get(f"{self.url}{self.route}") as response:
                await response.read()
            self.latencies.append(time.monotonic() - began)
            await asyncio.sleep(self.pause)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1],
            "mean": statistics.fmean(ordered)}


def prompts(clients: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts (no shared prefix to reuse) of ordinary vocabulary ids."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(tokens)] for _ in range(clients)]


async def one_request(session: aiohttp.ClientSession, url: str, ids: list[int], ended: list[float]) -> str:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    async with session.post(f"{url}/generate", json=body) as response:
        reply = await response.json()
    ended.append(time.monotonic())
    return reply["meta_info"]["finish_reason"]["type"] if response.status == 200 else f"http {response.status}"


async def abort_all(session: aiohttp.ClientSession, url: str, delay: float) -> tuple[float, float]:
    await asyncio.sleep(delay)
    began = time.monotonic()
    async with session.post(f"{url}/abort_request", json={"abort_all": True}) as response:
        await response.read()
    return began, time.monotonic() - began


async def drive(url: str, load: list[list[int]], abort_after: float) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        probers = [Prober(session, url, route, pause) for route, pause in PROBES.items()]
        probing = [asyncio.ensure_future(p.run()) for p in probers]
        ended: list[float] = []
        requests = asyncio.gather(*(one_request(session, url, ids, ended) for ids in load))
        began, answer_s = await abort_all(session, url, abort_after)
        outcomes = await requests
        for prober in probers:
            prober.running = False
        await asyncio.gather(*probing)
    return {"abort_answer_s": answer_s, "all_returned_s": max(ended) - began,
            "outcomes": {o: outcomes.count(o) for o in set(outcomes)},
            **{route: percentiles(p.latencies) for route, p in zip(PROBES, probers)}}


def run_checkout(name: str, path: str | None, load: list[list[int]], args: argparse.Namespace) -> dict:
    env_before = os.environ.get("PYTHONPATH")
    if path:
        os.environ["PYTHONPATH"] = path
    try:
        with ServerProcess("default", {"torch_num_threads": args.threads}) as server:
            warm = asyncio.run(drive(server.url, load[:1], abort_after=60.0))  # one request: imports, first step
            result = asyncio.run(drive(server.url, load, args.abort_after))
    finally:
        os.environ.pop("PYTHONPATH", None) if env_before is None else os.environ.update(PYTHONPATH=env_before)
    print(f"{name}: {json.dumps(result)}", flush=True)
    return {"checkout": path, "commit": commit_of(path), "warm_up_outcomes": warm["outcomes"], **result}


def commit_of(path: str | None) -> str:
    """The git commit of the furcate a PYTHONPATH directory holds (its `furcate` link), or of this one."""
    root = pathlib.Path(path) / "furcate" if path else pathlib.Path(__file__).parents[1]
    run = subprocess.run(["git", "-C", str(root.resolve()), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True)
    return run.stdout.strip() or "unknown"


def report(results: dict, facts: dict) -> str:
    commits = ", ".join(f"{name} = {r['commit']}" for name, r in results.items())
    lines = [f"# Responsiveness under a heavy-prompt load ({facts['date']})", "",
             f"CPU flags: {' '.join(facts['cpu_flags']) or 'none of avx512_bf16/amx_tile'} (avx2/avx512f: "
             f"{' '.join(facts['isa'])}); {facts['cpus']} CPUs, {facts['threads']} threads; load average before: "
             f"{facts['load_before']:.2f}; {facts['clients']} clients x {facts['prompt_tokens']} prompt tokens, "
             f"abort_all after {facts['abort_after']} s; FURCATE_AUTO_COMPILE={facts['auto_compile']}; Python "
             f"{facts['python']}, torch {facts['torch']}, aiohttp {facts['aiohttp']}; checkouts: "
             f"{commits}.", "",
             "| checkout | /health p50 / p99 / max (s) | /get_load p99 / max (s) | /get_server_info p99 / max (s) "
             "| abort_all answered (s) | all returned (s) | outcomes |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        health, load, info = r["/health"], r["/get_load"], r["/get_server_info"]
        lines.append(f"| {name} | {health['p50']:.3f} / {health['p99']:.3f} / {health['max']:.3f} "
                     f"| {load['p99']:.3f} / {load['max']:.3f} | {info['p99']:.3f} / {info['max']:.3f} "
                     f"| {r['abort_answer_s']:.3f} | {r['all_returned_s']:.2f} | {r['outcomes']} |")
    return "\n".join(lines) + "\n"


def isa_flags() -> list[str]:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    return sorted(flag for flag in ("avx2", "avx512f") if f" {flag}" in text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkouts", nargs="*", default=[], help="NAME=PYTHONPATH_DIR; none: this furcate only")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--abort-after", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="4 clients x 3,000 tokens, abort after 8 s")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.prompt_tokens, args.abort_after = 4, 3000, 8.0
    load = prompts(args.clients, args.prompt_tokens)
    facts = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu_flags": cpu_flags(),
             "isa": isa_flags(), "cpus": os.cpu_count(), "threads": args.threads, "load_before": os.getloadavg()[0],
             "clients": args.clients, "prompt_tokens": args.prompt_tokens, "abort_after": args.abort_after,
             "python": platform.python_version(), "torch": torch.__version__, "aiohttp": aiohttp.__version__,
             "auto_compile": os.environ.get("FURCATE_AUTO_COMPILE", "1")}
    checkouts = dict(item.split("=", 1) for item in args.checkouts) or {"this": None}
    results = {name: run_checkout(name, path, load, args) for name, path in checkouts.items()}
    RESULTS.mkdir(exist_ok=True)
    name = f"responsiveness_{args.clients}x{args.prompt_tokens}"
    (RESULTS / f"{name}.json").write_text(json.dumps({"facts": facts, "results": results}, indent=2))
    (RESULTS / f"{name}.md").write_text(report(results, facts))
    print(report(results, facts))


if __name__ == "__main__":
    main()
