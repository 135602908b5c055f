"""RL weight updates on the default model, each beside the plain torch operation that moves the same bytes.

`python -m furcate.benchmarks.weight_update`: update_weights_from_tensor against a load_state_dict of the same
tensors in one process; update_weights_from_distributed from a trainer process against a plain gloo broadcast
of the same tensors between two bare processes; update_weights_from_disk against torch.load of the same weights
saved with torch.save; then release/resume memory with the scheduler's resident memory before and after. The
engine runs dense (quantization none: updates write dense weights) in its default dtype. Writes
benchmarks/results/weight_update.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .peers_report import cpu_flags

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PEER = """
import sys, time, torch, torch.distributed as dist
from furcate.runtime.distributed.weight_group import init_weight_group
rank, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tensors = list(torch.load(path).values())
group = init_weight_group("127.0.0.1", port, rank, 2, "bench", "gloo", 120)
for _ in range(int(sys.argv[4])):
    sys.stdin.readline() if rank == 0 else None
    started = time.perf_counter()
    for t in tensors:
        dist.broadcast(t if rank == 0 else torch.empty_like(t), src=0, group=group)
    print(time.perf_counter() - started, flush=True)
dist.destroy_process_group(group)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def best(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peer(rank: int, port: int, path: str, rounds: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, str(rank), str(port), path, str(rounds)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


def plain_broadcast(path: str, rounds: int) -> float:
    port = free_port()
    sender, receiver = peer(0, port, path, rounds), peer(1, port, path, rounds)
    for _ in range(rounds):
        sender.stdin.write("go\n")
    times = [float(receiver.stdout.readline()) for _ in range(rounds)]
    sender.wait()
    receiver.wait()
    return min(times)


def engine_broadcast(engine, path: str, state: dict, rounds: int) -> float:
    port = free_port()
    sender = peer(0, port, path, rounds)
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "bench", "gloo", 120)[0]
    names, shapes = list(state), [list(t.shape) for t in state.values()]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in state.values()]
    times = []
    with ThreadPoolExecutor(1) as pool:
        for _ in range(rounds):
            started = time.perf_counter()
            update = pool.submit(engine.update_weights_from_distributed, names, dtypes, shapes, "bench")
            sender.stdin.write("go\n")
            assert update.result()[0]
            times.append(time.perf_counter() - started)
    sender.wait()
    engine.destroy_weights_update_group("bench")
    return min(times)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from furcate import Engine
    from furcate.runtime.model.weights.default_model import prepare_default_model

    flags, load_before = cpu_flags(), os.getloadavg()
    model_dir = str(prepare_default_model())
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    state = {name: t.contiguous() for name, t in state.items() if name != "lm_head.weight"}  # tied
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    scratch = tempfile.mkdtemp(prefix="furcate-bench-")
    pt_path = os.path.join(scratch, "weights.pt")
    torch.save(state, pt_path)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows: dict[str, dict] = {}
    with Engine(model_dir, quantization="none", torch_num_threads=args.threads) as engine:
        rows["from_tensor"] = {"furcate": best(lambda: engine.update_weights_from_tensor(list(state.items())),
                                               args.rounds),
                               "peer": best(lambda: reference.load_state_dict(state, strict=False), args.rounds),
                               "peer_name": "load_state_dict in one process"}
        rows["from_disk"] = {"furcate": best(lambda: engine.update_weights_from_disk(model_dir), args.rounds),
                             "peer": best(lambda: torch.load(pt_path), args.rounds),
                             "peer_name": "torch.load of the same weights"}
        rows["from_distributed"] = {"furcate": engine_broadcast(engine, pt_path, state, args.rounds),
                                    "peer": plain_broadcast(pt_path, args.rounds),
                                    "peer_name": "gloo broadcast between two bare processes"}
        memory = release_resume(engine)
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "cpu_flags": flags,
            "load_before": load_before, "load_after": os.getloadavg(), "threads": args.threads,
            "bytes": nbytes, "torch": torch.__version__, "updates": rows, "memory": memory}


def release_resume(engine) -> dict:
    pid = engine._process.pid
    before = rss_mb(pid)
    started = time.perf_counter()
    assert engine.release_memory_occupation()[0]
    released_s, released = time.perf_counter() - started, rss_mb(pid)
    started = time.perf_counter()
    assert engine.resume_memory_occupation()[0]
    return {"rss_before_mb": before, "rss_released_mb": released, "release_s": released_s,
            "resume_s": time.perf_counter() - started, "rss_resumed_mb": rss_mb(pid)}


def markdown(report: dict) -> str:
    lines = [f"# Weight updates, default model ({report['bytes'] / 2**20:.0f} MiB of float32 tensors)", "",
             f"{report['date']}; CPU flags {report['cpu_flags'] or 'none of avx512_bf16/amx_tile'}; "
             f"{report['threads']} threads; load before {report['load_before']}, after {report['load_after']}; "
             f"torch {report['torch']}.", "",
             "| update | furcate s | plain torch s | ratio (furcate / plain) | plain torch does |",
             "|---|---|---|---|---|"]
    for name, row in report["updates"].items():
        lines.append(f"| {name} | {row['furcate']:.3f} | {row['peer']:.3f} | {row['furcate'] / row['peer']:.2f} | "
                     f"{row['peer_name']} |")
    m = report["memory"]
    lines += ["", f"release_memory_occupation (weights + kv_cache): {m['release_s']:.2f} s, scheduler RSS "
              f"{m['rss_before_mb']:.0f} -> {m['rss_released_mb']:.0f} MiB; resume {m['resume_s']:.2f} s, RSS "
              f"{m['rss_resumed_mb']:.0f} MiB.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    report = run(parser.parse_args())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_update.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "weight_update.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
