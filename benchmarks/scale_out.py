"""Scale-out benchmarks on the default model, one section each, selected with --sections:

  dp  data parallelism: `furcate serve --dp-size 2` behind sglang-router with the cache_aware policy vs the
      round_robin policy, and one single server (dp 1) as the reference, on the same seeded workload.
  (pd, prefill/decode disaggregation, is planned as a second section.)

dp workload: many prefix groups (G distinct system prompts of a few hundred tokens, P short questions each),
every request streamed through native /generate, the arrival order a seeded shuffle across groups, a fixed
number of requests in flight. In the first pair each worker's KV pool holds about half of the groups' prefixes
plus the running requests, so a policy that splits the groups between the workers can keep every prefix cached,
while one that sends every group to both workers makes each worker hold all of them (and evict); the single
server gets the two workers' pools and both cores. The second pair runs on default pools, where every prefix
fits, leaving only the recomputation of a prefix once per worker that sees its group.

Per deployment: req/s, output tok/s, mean/p50/p99 end-to-end latency, TTFT, the cache hit rate
sum(cached_tokens) / sum(prompt_tokens) from the responses' meta_info, and the requests each worker served
(its furcate_requests_total counter). Then cache_aware / round_robin for hit rate and throughput.

Results merge into benchmarks/results/scale_out.{json,md} (scale_out_quick.* with --quick) by section, so
running one section keeps the others' last results.

    python -m benchmarks.scale_out [--quick] [--sections dp]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import os
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import requests

from benchmarks.scale_out_pd import pd_markdown, run_pd
from benchmarks.serving import (
    RESULTS,
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
    ms,
    shared_prefix_workload,
    steady,
    summarize,
    wait_until_idle,
)
from benchmarks.shared_prefix import oracle_hit_rate
from furcate.runtime.server.server_process import ServerProcess

# -- dp: data parallelism behind sglang-router ------------------------------------------------------------------

@dataclass
class Deployment:
    label: str
    dp_size: int
    router_policy: str | None  # None: a single server, no router
    threads_per_worker: int
    kv_tokens_per_worker: int | None  # None: the engine's default pool (sized from free memory)


# The policy pairs compared: (cache_aware label, round_robin label, what their pools are).
PAIRS = [("dp 2, cache_aware", "dp 2, round_robin", "pools sized to half of the groups"),
         ("dp 2, cache_aware, default pool", "dp 2, round_robin, default pool", "default pools (from free memory)")]


def dp_deployments(cores: int, kv_per_worker: int) -> list[Deployment]:
    # Same cores and same KV memory in total for the first three: the two workers split them, the single server
    # has them all. The default-pool pair then shows what is left of the gap once capacity is no constraint.
    half = max(1, cores // 2)
    return [Deployment("single server (dp 1)", 1, None, cores, 2 * kv_per_worker),
            Deployment(PAIRS[0][0], 2, "cache_aware", half, kv_per_worker),
            Deployment(PAIRS[0][1], 2, "round_robin", half, kv_per_worker),
            Deployment(PAIRS[1][0], 2, "cache_aware", half, None),
            Deployment(PAIRS[1][1], 2, "round_robin", half, None)]


def start(deployment: Deployment) -> ServerProcess:
    extra: tuple[str, ...] = ()
    if deployment.router_policy is not None:
        extra = ("--dp-size", str(deployment.dp_size), "--router-policy", deployment.router_policy)
    return ServerProcess("default", {"torch_num_threads": deployment.threads_per_worker,
                                     "max_total_tokens": deployment.kv_tokens_per_worker}, extra_args=extra)


def worker_urls(url: str, dp_size: int) -> list[str]:
    """The workers behind the router, as the router lists them (the server itself when there is no router)."""
    if dp_size == 1:
        return [url]
    return sorted(w["url"] for w in requests.get(f"{url}/workers", timeout=30).json()["workers"])


def requests_served(worker: str) -> int:
    """Requests the worker finished, from its Prometheus counter (summed over finish reasons)."""
    text = requests.get(f"{worker}/metrics", timeout=30).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("furcate_requests_total{")))


def warm_up_workers(workers: list[str], workload: Workload) -> None:
    """Untimed requests sent to each worker directly: first forwards of each shape, on text never timed, and
    unseen by the router, whose cache_aware tree must start the timed run empty."""
    reqs = [Request("Warm-up." + r.prompt[: len(r.prompt) // 2], 0, 4) for r in workload.requests[:2]]
    for worker in workers:
        outcomes, _ = asyncio.run(drive(worker, NativeProtocol(), reqs, Mode("warm-up", 2), 0))
        bad = [o.error for o in outcomes if not o.ok]
        if bad:
            raise RuntimeError(f"warm-up on {worker} failed: {bad[0]}")


def measure_once(system: FurcateServer, workers: list[str], workload: Workload, mode: Mode, seed: int,
                 watchdog: Watchdog) -> dict:
    asyncio.run(system.reset())  # /flush_cache through the router reaches every worker
    served_before = [requests_served(w) for w in workers]
    meter = CpuMeter()
    outcomes, wall = asyncio.run(drive(system.url, system.protocol, workload.requests, mode, seed, watchdog))
    row = summarize(workload, outcomes, wall, meter.foreign_share())
    done = [o.e2e for o in outcomes if o.ok]
    prompt, cached = row["server_prompt_tokens"], row["cached_prompt_tokens"]
    return row | {"e2e_mean_s": statistics.fmean(done) if done else None,
                  "ttft_mean_ms": ms(statistics.fmean(o.ttft for o in outcomes if o.ok)) if done else None,
                  "cache_hit_rate": cached / prompt if prompt and cached is not None else None,
                  "requests_per_worker": [requests_served(w) - b for w, b in zip(workers, served_before)]}


def engine_facts(workers: list[str]) -> dict:
    """The first worker's settings, and every worker's KV pool (default pools differ: each worker sizes its own
    from the memory free when it starts)."""
    infos = [requests.get(f"{w}/get_server_info", timeout=30).json() for w in workers]
    facts = {k: infos[0][k] for k in ("resolved_dtype", "quantized_layers", "torch_num_threads", "schedule_policy",
                                      "chunked_prefill_size", "model_path") if k in infos[0]}
    return facts | {"max_total_num_tokens": [info["max_total_num_tokens"] for info in infos]}


def common_engine_facts(facts: dict) -> dict:
    """What every deployment shares (threads and pool size differ by deployment)."""
    return {k: v for k, v in facts.items() if k not in ("torch_num_threads", "max_total_num_tokens")}


def run_deployment(deployment: Deployment, workload: Workload, mode: Mode, seed: int, policy: Policy) -> dict:
    started = time.perf_counter()
    server = start(deployment)
    try:
        workers = worker_urls(server.url, deployment.dp_size)
        warm_up_workers(workers, workload)
        system = FurcateServer(deployment.label, server.url, NativeProtocol(), server.stop)
        load = loadavg()  # the load average lags by minutes; the idle check in steady() is the sharper figure
        once = functools.partial(measure_once, system, workers, workload, mode, seed)
        row = steady(policy, deployment.label, once)
        return {"deployment": asdict(deployment), "loadavg_before": load, "engine": engine_facts(workers),
                "startup_and_run_seconds": time.perf_counter() - started, **row}
    finally:
        server.stop()


def kv_for_half_the_groups(args: argparse.Namespace) -> int:
    """A dp-2 worker's pool: half of the groups' prefixes plus half of the requests in flight, 15% to spare. A
    worker that is sent every group cannot keep all prefixes cached in it; one sent half of them can."""
    request_tokens = args.prefix_len + args.suffix_len + args.output_len
    return int(1.15 * (args.groups * args.prefix_len + args.concurrency * request_tokens) / 2)


def dp_workload(tokenizer, args: argparse.Namespace) -> Workload:
    workload = shared_prefix_workload(tokenizer, args.groups, args.prompts_per_group, args.prefix_len,
                                      args.suffix_len, args.output_len, args.seed)
    # serving.py interleaves groups strictly (g0, g1, ..., g0, ...). With an even group count, round robin over
    # two workers would then send each group to one worker every time and look cache-aware by accident; a seeded
    # shuffle keeps the groups interleaved without that parity.
    random.Random(args.seed).shuffle(workload.requests)
    return workload


def dp_ratios(aware: dict, robin: dict) -> dict:
    def ratio(key: str) -> float | None:
        return aware[key] / robin[key] if aware.get(key) and robin.get(key) else None

    return {"cache_hit_rate": ratio("cache_hit_rate"), "output_tok_s": ratio("output_tok_s"),
            "requests_per_s": ratio("requests_per_s"), "e2e_mean_s": ratio("e2e_mean_s")}


def run_dp(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from furcate.runtime.model.weights.default_model import prepare_default_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    workload = dp_workload(tokenizer, args)
    mode = Mode(f"conc={args.concurrency}", concurrency=args.concurrency)
    policy = Policy(args.wait_idle, args.retries)
    rows: dict[str, dict] = {}
    for deployment in dp_deployments(args.cores, args.kv_per_worker or kv_for_half_the_groups(args)):
        print(f"{deployment.label}: starting (load {loadavg()})", flush=True)
        rows[deployment.label] = run_deployment(deployment, workload, mode, args.seed, policy)
        print("  " + brief(rows[deployment.label]), flush=True)
    prompts = [tokenizer.encode(r.prompt) for r in workload.requests]
    return {"workload": {"description": workload.description + ", arrival order shuffled (seeded)",
                         "requests": len(workload.requests), "prompt_tokens": workload.prompt_tokens,
                         "output_tokens": workload.output_tokens, "prefix_tokens_all_groups":
                         args.groups * args.prefix_len, "oracle_hit_rate": oracle_hit_rate(prompts)},
            "arrivals": mode.name, "deployments": rows,
            "ratios_cache_aware_over_round_robin": {pools: dp_ratios(rows[a], rows[r]) for a, r, pools in PAIRS},
            "waited_seconds": policy.waited_s}


def brief(row: dict) -> str:
    parts = [f"{row['requests_per_s']:.2f} req/s", f"{row['output_tok_s']:.1f} tok/s",
             f"E2E mean {row['e2e_mean_s']:.2f} s", f"hit rate {fmt(row['cache_hit_rate'], '{:.1%}')}",
             f"per worker {row['requests_per_worker']}", f"foreign CPU {row['foreign_cpu_share']:.1%}"]
    if row["failed"]:
        parts.append(f"{row['failed']} FAILED {row['errors']}")
    return ", ".join(parts)


def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


DP_COLUMNS = [("req/s", "requests_per_s", "{:.2f}"), ("out tok/s", "output_tok_s", "{:.1f}"),
              ("E2E mean s", "e2e_mean_s", "{:.2f}"), ("E2E p50 s", "e2e_p50_s", "{:.2f}"),
              ("E2E p99 s", "e2e_p99_s", "{:.2f}"), ("TTFT mean ms", "ttft_mean_ms", "{:.0f}"),
              ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"), ("cache hit", "cache_hit_rate", "{:.1%}"),
              ("requests per worker", "requests_per_worker", "{}"), ("failed", "failed", "{}"),
              ("load avg before", "loadavg_before", "{}"), ("foreign CPU", "foreign_cpu_share", "{:.1%}")]


def dp_markdown(section: dict) -> list[str]:
    w, rows, ratios = section["workload"], section["deployments"], section["ratios_cache_aware_over_round_robin"]
    first = next(iter(rows.values()))
    retried = [f"{label} ({len(row['discarded_attempts_foreign_cpu'])}x)" for label, row in rows.items()
               if row.get("discarded_attempts_foreign_cpu")]
    lines = [f"## dp: data parallelism behind sglang-router ({section['date']})", "",
             f"Workload: {w['description']}; {w['requests']} requests, {w['prompt_tokens']} prompt tokens, "
             f"{w['output_tokens']} output tokens; {section['arrivals']} (requests in flight), every request "
             "streamed through native `/generate`, greedy, ignore_eos. An oracle that computes each distinct "
             f"prefix once would hit {w['oracle_hit_rate']:.1%}.", "",
             f"Engine: default model, `{json.dumps(common_engine_facts(first['engine']))}`; KV pool and threads "
             "per worker are in the table (each deployment's own in the JSON). The groups' prefixes total "
             f"{w['prefix_tokens_all_groups']} tokens: a dp-2 worker that gets every group must hold them all "
             "next to its running requests, one that gets half of the groups only half.", "",
             "| deployment | threads x workers | KV tokens per worker | "
             + " | ".join(c[0] for c in DP_COLUMNS) + " |", "|---" * (len(DP_COLUMNS) + 3) + "|"]
    for label, row in rows.items():
        d, pool = row["deployment"], ", ".join(map(str, row["engine"]["max_total_num_tokens"]))
        cells = [fmt(row.get(key), spec) for _, key, spec in DP_COLUMNS]
        lines.append(f"| {label} | {d['threads_per_worker']} x {d['dp_size']} | {pool} | " + " | ".join(cells) + " |")
    lines.append("")
    for pools, r in ratios.items():
        lines.append(f"- cache_aware / round_robin, {pools}: hit rate {fmt(r['cache_hit_rate'], '{:.2f}x')}, "
                     f"output tok/s {fmt(r['output_tok_s'], '{:.2f}x')}, req/s {fmt(r['requests_per_s'], '{:.2f}x')}, "
                     f"mean E2E {fmt(r['e2e_mean_s'], '{:.2f}x')} (below 1 is faster)")
    lines.append("")
    if retried:
        lines += [f"Measured again because other processes took over 5% of the CPU: {', '.join(retried)}.", ""]
    busy = [label for label, row in rows.items() if row["disturbed"]]
    if busy:
        lines += [f"Other processes still took over 5% of the CPU during: {', '.join(busy)}; treat those figures "
                  "as rough. A stolen core hurts one 2-thread server (its threads wait for each other at every "
                  "parallel region) more than two 1-thread workers, so the single server's row suffers most; the "
                  "hit rates much less so.", ""]
    lines += ["What this machine cannot show: it has 2 cores, so the two workers of a dp-2 deployment share the "
              "cores one single server would use (1 thread each instead of 2). Throughput gained from data "
              "parallelism itself (more hardware serving at once) is not measurable here; the dp-2 vs single "
              "server throughput only says what splitting the same cores costs or saves. Between the two "
              "policies the hardware is identical, so their throughput ratio reflects prefill work saved by "
              "cache hits, and the cache hit rate is the meaningful figure. Latencies include the router's hop "
              "(one extra loopback HTTP proxy) for dp 2, not for the single server.", ""]
    return lines


SECTIONS: dict[str, tuple[Callable[[argparse.Namespace], dict], Callable[[dict], list[str]]]] = {
    "dp": (run_dp, dp_markdown),
    "pd": (run_pd, pd_markdown),
}


# -- report and main ------------------------------------------------------------------------------------------

def write_markdown(path: pathlib.Path, report: dict) -> None:
    lines = ["# Scale-out benchmarks", "",
             f"CPU, {report['machine']['cores']} cores, furcate servers started by `furcate serve` "
             "(sglang-router in front for dp > 1). Each section records its own date, command and machine load.", ""]
    for name, section in report["sections"].items():
        lines += SECTIONS[name][1](section)
        lines += [f"Command: `{section['command']}`; load average before the section {section['loadavg_before']}, "
                  f"after {section['loadavg_after']}; {section['total_seconds']:.0f} s in all, of which "
                  f"{section['waited_seconds']:.0f} s waiting for other processes to go quiet.", ""]
    path.write_text("\n".join(lines))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (few groups, short prompts)")
    parser.add_argument("--sections", default="dp,pd", help=f"comma list of {sorted(SECTIONS)}")
    parser.add_argument("--groups", type=int, default=24, help="dp: distinct system prompts")
    parser.add_argument("--prompts-per-group", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=256, help="dp: tokens of each system prompt")
    parser.add_argument("--suffix-len", type=int, default=24, help="dp: tokens of each question")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="dp: requests in flight")
    parser.add_argument("--kv-per-worker", type=int, default=None,
                        help="dp: KV pool tokens of each dp-2 worker, the single server gets twice this "
                             "(default: half of the groups' prefixes and of the requests in flight, +15%%)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the single server; each dp-2 worker gets half")
    parser.add_argument("--wait-idle", type=float, default=20.0,
                        help="before each timed run, wait up to this many seconds for other processes to go quiet")
    parser.add_argument("--retries", type=int, default=1,
                        help="measure a run again (at most this often) when other processes took its CPU")
    parser.add_argument("--pd-requests", type=int, default=32, help="pd: requests")
    parser.add_argument("--pd-input-len", type=int, default=768, help="pd: longest prompt (uniform from half)")
    parser.add_argument("--pd-output-len", type=int, default=32)
    parser.add_argument("--pd-concurrency", type=int, default=4, help="pd: requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path; the .md goes beside it")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.prompts_per_group, args.prefix_len, args.suffix_len = 6, 3, 96, 8
        args.output_len, args.concurrency, args.wait_idle = 4, 4, 5.0
        args.pd_requests, args.pd_input_len, args.pd_output_len, args.pd_concurrency = 6, 128, 4, 2
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {sorted(SECTIONS)}")
    args.output = args.output or str(RESULTS / ("scale_out_quick.json" if args.quick else "scale_out.json"))
    return args


def main() -> None:
    args = parse_args()
    out = pathlib.Path(args.output)
    # Sections merge into the existing results: running one section leaves the others' last results in place.
    report = json.loads(out.read_text()) if out.exists() else {"sections": {}}
    report["machine"] = {"cores": os.cpu_count()}
    for name in args.sections.split(","):
        idle_share = wait_until_idle(0.0)
        print(f"section {name}: load {loadavg()}, other processes use {idle_share:.0%} of the CPU", flush=True)
        started = time.perf_counter()
        section = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
                   "config": vars(args), "loadavg_before": loadavg(), "foreign_cpu_share_before": idle_share}
        section |= SECTIONS[name][0](args)
        section |= {"loadavg_after": loadavg(), "total_seconds": time.perf_counter() - started}
        report["sections"][name] = section
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        write_markdown(out.with_suffix(".md"), report)
        print("\n".join(SECTIONS[name][1](section)), flush=True)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
