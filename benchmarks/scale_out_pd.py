"""scale_out.py's pd section: prefill/decode disaggregation against one server on the same cores and memory.

Deployments: a single server (all cores, the whole KV budget), and `furcate serve --pd-disaggregation` (one
prefill and one decode server behind sglang-router in PD mode, half the cores and half the budget each), once per
KV transfer backend (Mooncake over TCP, NIXL over UCX). Workload: prompts long enough that prefill is the costly
part, a fixed number of requests in flight, every request streamed through native /generate. Reported: TTFT and
inter-token latency (p50/p99), throughput, and per request the K/V bytes the prefill server wrote into the decode
server and the time the write took (the prefill server's kv_transfer_* counters).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import statistics
import time
from dataclasses import asdict, dataclass

import requests

from benchmarks.serving import (
    CpuMeter,
    FurcateServer,
    Mode,
    NativeProtocol,
    Policy,
    Request,
    Watchdog,
    Workload,
    drive,
    loadavg,
    random_workload,
    steady,
    summarize,
)
from furcate.runtime.server.server_process import ServerProcess

TRANSFER_COUNTERS = ("kv_transfers", "kv_transfer_bytes", "kv_transfer_seconds", "kv_transfer_writes",
                     "kv_transfer_failures")


@dataclass
class PdDeployment:
    label: str
    backend: str | None  # None: a single server
    threads_per_server: int
    kv_tokens_per_server: int


def pd_deployments(cores: int, kv_tokens: int) -> list[PdDeployment]:
    rows = [PdDeployment("single server", None, cores, kv_tokens)]
    for backend, module in (("mooncake", "mooncake.engine"), ("nixl", "nixl_cu12")):
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            rows.append(PdDeployment(f"PD 1+1, {backend}", backend, max(1, cores // 2), kv_tokens // 2))
    return rows


def start(deployment: PdDeployment) -> ServerProcess:
    args = {"torch_num_threads": deployment.threads_per_server, "max_total_tokens": deployment.kv_tokens_per_server}
    if deployment.backend is None:
        return ServerProcess("default", args)
    return ServerProcess("default", {**args, "disaggregation_transfer_backend": deployment.backend},
                         extra_args=("--pd-disaggregation",))


def servers_by_mode(url: str, disaggregated: bool) -> dict[str, str]:
    """{"prefill": URL, "decode": URL} behind the router, or {"single": URL}."""
    if not disaggregated:
        return {"single": url}
    found = {}
    for worker in requests.get(f"{url}/workers", timeout=30).json()["workers"]:
        info = requests.get(f"{worker['url']}/get_server_info", timeout=30).json()
        found[info["disaggregation_mode"]] = worker["url"]
    return found


def transfer_counters(servers: dict[str, str]) -> dict[str, float]:
    if "prefill" not in servers:
        return {}
    stats = requests.get(f"{servers['prefill']}/get_server_info", timeout=30).json()["internal_states"][0]
    return {k: stats[k] for k in TRANSFER_COUNTERS}


def measure_once(system: FurcateServer, servers: dict[str, str], workload: Workload, mode: Mode, seed: int,
                 watchdog: Watchdog) -> dict:
    for url in servers.values():  # the router does not fan /flush_cache out to PD workers
        requests.post(f"{url}/flush_cache", timeout=60)
    before = transfer_counters(servers)
    meter = CpuMeter()
    outcomes, wall = asyncio.run(drive(system.url, system.protocol, workload.requests, mode, seed, watchdog))
    row = summarize(workload, outcomes, wall, meter.foreign_share())
    done = [o for o in outcomes if o.ok]
    row["ttft_mean_ms"] = statistics.fmean(o.ttft for o in done) * 1000 if done else None
    after = transfer_counters(servers)
    if after:
        delta = {k: after[k] - before[k] for k in TRANSFER_COUNTERS}
        count = delta["kv_transfers"] or 1
        row["kv_transfer"] = delta | {
            "mean_bytes_per_request": delta["kv_transfer_bytes"] / count,
            "mean_ms_per_request": delta["kv_transfer_seconds"] / count * 1000,
            "mean_writes_per_request": delta["kv_transfer_writes"] / count,
            "gb_per_s": (delta["kv_transfer_bytes"] / delta["kv_transfer_seconds"] / 1e9
                         if delta["kv_transfer_seconds"] else None)}
    return row


def warm_up(url: str, workload: Workload) -> None:
    reqs = [Request("Warm-up. " + r.prompt[: len(r.prompt) // 3], 0, 4) for r in workload.requests[:2]]
    outcomes, _ = asyncio.run(drive(url, NativeProtocol(), reqs, Mode("warm-up", 2), 0))
    bad = [o.error for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError(f"warm-up on {url} failed: {bad[0]}")


def run_deployment(deployment: PdDeployment, workload: Workload, mode: Mode, seed: int, policy: Policy) -> dict:
    started = time.perf_counter()
    server = start(deployment)
    try:
        servers = servers_by_mode(server.url, deployment.backend is not None)
        warm_up(server.url, workload)
        system = FurcateServer(deployment.label, server.url, NativeProtocol(), server.stop)
        load = loadavg()
        row = steady(policy, deployment.label, functools.partial(measure_once, system, servers, workload, mode, seed))
        info = requests.get(f"{next(iter(servers.values()))}/get_server_info", timeout=30).json()
        return {"deployment": asdict(deployment), "loadavg_before": load,
                "engine": {k: info.get(k) for k in ("resolved_dtype", "quantized_layers", "chunked_prefill_size")},
                "startup_and_run_seconds": time.perf_counter() - started, **row}
    finally:
        server.stop()


def run_pd(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from furcate.runtime.model.weights.default_model import prepare_default_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    workload = random_workload(tokenizer, args.pd_requests, args.pd_input_len, 0.5, args.pd_output_len, args.seed)
    mode = Mode(f"conc={args.pd_concurrency}", concurrency=args.pd_concurrency)
    policy = Policy(args.wait_idle, args.retries)
    kv_tokens = 2 * args.pd_concurrency * (args.pd_input_len + args.pd_output_len) + 2048
    rows: dict[str, dict] = {}
    for deployment in pd_deployments(args.cores, kv_tokens):
        print(f"{deployment.label}: starting (load {loadavg()})", flush=True)
        rows[deployment.label] = run_deployment(deployment, workload, mode, args.seed, policy)
        print("  " + brief(rows[deployment.label]), flush=True)
    return {"workload": {"description": workload.description, "requests": len(workload.requests),
                         "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens},
            "arrivals": mode.name, "deployments": rows, "waited_seconds": policy.waited_s}


def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def brief(row: dict) -> str:
    parts = [f"{row['output_tok_s']:.1f} tok/s", f"TTFT p50 {fmt(row['ttft_p50_ms'], '{:.0f}')} ms",
             f"ITL p50/p99 {fmt(row['itl_p50_ms'], '{:.0f}')}/{fmt(row['itl_p99_ms'], '{:.0f}')} ms"]
    if "kv_transfer" in row:
        kv = row["kv_transfer"]
        parts.append(f"KV {kv['mean_bytes_per_request'] / 1e6:.1f} MB in {kv['mean_ms_per_request']:.1f} ms/request")
    if row["failed"]:
        parts.append(f"{row['failed']} FAILED {row['errors']}")
    return ", ".join(parts)


PD_COLUMNS = [("out tok/s", "output_tok_s", "{:.1f}"), ("req/s", "requests_per_s", "{:.2f}"),
              ("TTFT mean ms", "ttft_mean_ms", "{:.0f}"), ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
              ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"), ("ITL p50 ms", "itl_p50_ms", "{:.0f}"),
              ("ITL p99 ms", "itl_p99_ms", "{:.0f}"), ("TPOT mean ms", "tpot_mean_ms", "{:.0f}"),
              ("E2E p50 s", "e2e_p50_s", "{:.2f}"),
              ("failed", "failed", "{}"), ("load avg before", "loadavg_before", "{}"),
              ("foreign CPU", "foreign_cpu_share", "{:.1%}")]


def pd_markdown(section: dict) -> list[str]:
    w, rows = section["workload"], section["deployments"]
    lines = [f"## pd: prefill/decode disaggregation against a single server ({section['date']})", "",
             f"Workload: {w['description']}; {w['prompt_tokens']} prompt tokens, {w['output_tokens']} output tokens; "
             f"{section['arrivals']} (requests in flight), streamed through native `/generate`, greedy, ignore_eos. "
             f"Engine: default model, `{next(iter(rows.values()))['engine']}`.", "",
             "| deployment | threads x servers | KV tokens per server | " + " | ".join(c[0] for c in PD_COLUMNS)
             + " | KV per request | writes per request | transfer ms per request | transfer GB/s |",
             "|---" * (len(PD_COLUMNS) + 7) + "|"]
    for label, row in rows.items():
        d, kv = row["deployment"], row.get("kv_transfer")
        servers = 1 if d["backend"] is None else 2
        transfer = ["-", "-", "-", "-"] if kv is None else [
            f"{kv['mean_bytes_per_request'] / 1e6:.2f} MB", f"{kv['mean_writes_per_request']:.0f}",
            f"{kv['mean_ms_per_request']:.1f}",
            fmt(kv["gb_per_s"], "{:.2f}")]
        lines.append(f"| {label} | {d['threads_per_server']} x {servers} | {d['kv_tokens_per_server']} | "
                     + " | ".join(fmt(row.get(key), spec) for _, key, spec in PD_COLUMNS) + " | "
                     + " | ".join(transfer) + " |")
    lines += ["", "Streamed chunks pass through sglang-router in the PD rows and often arrive there together (ITL p50 "
              "0 ms), which moves TTFT later and shrinks TPOT ((E2E - TTFT) / (tokens - 1)); E2E is the figure "
              "the router cannot skew. Writes per request: (address, length) pieces, 2 x layers per stretch of "
              "consecutive KV slots; scattered slots make many small writes.", "",
              "What this machine cannot show: disaggregation pays off when prefill and decode run on separate "
              "accelerators, so a long prefill never stalls another request's decode step. Here the prefill and "
              "decode servers split the same 2 cores a single server uses (1 thread each instead of 2), and the "
              "K/V cross loopback TCP inside one machine, so the latencies say what the split costs on shared "
              "cores, not what it gains on separate hardware; the transfer figures are loopback figures "
              "(including per-request set-up, not the link's bandwidth).", ""]
    return lines
