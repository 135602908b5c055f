"""Engine-side CPU per generated token: 64 concurrent greedy requests on a tiny model, where the forward is cheap
and what the engine does around it (pickling outputs, detokenizing, building chunks) is most of the cost.

Each arm runs in its own process, importing `furcate` from a checkout of its own, so one run compares code
before and after a change:
  before    --before CHECKOUT (e.g. the main branch), requests not streamed
  after     this checkout, requests not streamed
  streamed  this checkout, the same requests streamed and read to the end (the per-step path streams keep)
CPU is counted apart for the engine's process (caller and receiver threads: time.process_time()) and the scheduler
process (/proc/<pid>/stat utime + stime); both exclude start-up and a warm-up call. Each round of each arm is a
fresh process and the arms take turns; the report gives medians. Every arm's greedy outputs must be the same tokens
and text, or the run fails. On a loaded machine the scheduler's CPU is noisy (its torch threads spin while a peer
is descheduled); the engine's is not.

    python -m benchmarks.engine_overhead [--before /path/to/main/checkout] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

WORDS = ("river stone garden signal market ladder window copper silent orange engine winter harbor pencil cloud "
         "forest matter bridge candle number planet velvet thunder basket mirror shadow spring anchor meadow").split()
PARAMS = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
HERE = pathlib.Path(__file__).resolve()


@dataclass
class Round:
    tokens: int
    wall_seconds: float
    engine_cpu_seconds: float
    scheduler_cpu_seconds: float

    @property
    def engine_us_per_token(self) -> float:
        return 1e6 * self.engine_cpu_seconds / self.tokens

    @property
    def scheduler_us_per_token(self) -> float:
        return 1e6 * self.scheduler_cpu_seconds / self.tokens


# -- one arm, in its own process ---------------------------------------------------------------------------------

def process_cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40))) for _ in range(count)]


async def generate_all(engine, texts: list[str], stream: bool) -> list[list[int]]:
    async def one(text: str) -> list[int]:
        if not stream:
            return (await engine.async_generate(text, PARAMS))["output_ids"]
        last = None
        async for chunk in await engine.async_generate(text, PARAMS, stream=True):
            last = chunk
        return last["output_ids"]

    return list(await asyncio.gather(*(one(text) for text in texts)))


def run_arm(model_dir: str, requests: int, stream: bool, threads: int) -> dict:
    from furcate import Engine

    texts = prompts(requests, seed=0)
    with Engine(model_dir, dtype="float32", quantization="none", grammar_backend="none", torch_num_threads=threads,
                max_total_tokens=requests * 200, max_running_requests=requests) as engine:
        asyncio.run(generate_all(engine, texts[:4], stream))  # warm-up: first-call costs are not per token
        assert engine.flush_cache()  # the measured round prefills every prompt from scratch
        cpu, scheduler, wall = time.process_time(), process_cpu_seconds(engine._process.pid), time.perf_counter()
        outputs = asyncio.run(generate_all(engine, texts, stream))
        measured = Round(sum(map(len, outputs)), time.perf_counter() - wall, time.process_time() - cpu,
                         process_cpu_seconds(engine._process.pid) - scheduler)
        texts_out = [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
    digest = hashlib.sha256(json.dumps([outputs, texts_out]).encode()).hexdigest()
    return {"round": asdict(measured), "outputs_sha256": digest}


# -- the comparison ----------------------------------------------------------------------------------------------

def furcate_path(checkout: pathlib.Path, scratch: pathlib.Path, label: str) -> str:
    """A PYTHONPATH entry under which `import furcate` is `checkout` (the repository root is the package)."""
    entry = scratch / label
    entry.mkdir()
    (entry / "furcate").symlink_to(checkout.resolve())
    return str(entry)


def spawn_arm(pythonpath: str, args: argparse.Namespace, model_dir: str, stream: bool) -> dict:
    """One measured round of one arm, in a fresh process."""
    command = [sys.executable, str(HERE), "--arm", "--model-dir", model_dir, "--requests", str(args.requests),
               "--threads", str(args.threads)] + (["--stream"] if stream else [])
    done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=pythonpath), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"arm failed ({pythonpath}, stream={stream}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    if len({run["outputs_sha256"] for run in runs}) != 1:
        raise RuntimeError("one arm generated different outputs in different rounds")
    rounds = [Round(**run["round"]) for run in runs]
    return {
        "tokens_per_round": rounds[0].tokens,
        "engine_us_per_token": statistics.median(r.engine_us_per_token for r in rounds),
        "scheduler_us_per_token": statistics.median(r.scheduler_us_per_token for r in rounds),
        "wall_seconds": statistics.median(r.wall_seconds for r in rounds),
        "rounds": [run["round"] for run in runs],
        "outputs_sha256": runs[0]["outputs_sha256"],
    }


def git_commit(checkout: pathlib.Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or "unknown"


def cpu_flags() -> list[str]:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    return sorted({flag for flag in ("avx512_bf16", "amx_tile") if f" {flag}" in text})


def build_model(scratch: pathlib.Path) -> str:
    from furcate.runtime.model.weights.default_model import prepare_default_model
    from tests.tiny_models import build_tiny_model  # run from the repository root, like every benchmark

    return str(build_tiny_model("llama", scratch / "tiny-llama", prepare_default_model()))


def compare(args: argparse.Namespace) -> dict:
    after_checkout = HERE.parent.parent
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = pathlib.Path(scratch_name)
        model_dir = build_model(scratch)
        after = furcate_path(after_checkout, scratch, "after")
        plan = {"after": (after, False), "streamed": (after, True)}
        if args.before:
            plan = {"before": (furcate_path(pathlib.Path(args.before), scratch, "before"), False), **plan}
        runs: dict[str, list[dict]] = {name: [] for name in plan}
        # The arms take turns, one round each, so a change in the machine's load falls on all of them alike.
        for _ in range(args.rounds):
            for name, (pythonpath, stream) in plan.items():
                runs[name].append(spawn_arm(pythonpath, args, model_dir, stream))
    arms = {name: summary(done) for name, done in runs.items()}
    digests = {name: arm["outputs_sha256"] for name, arm in arms.items()}
    if len(set(digests.values())) != 1:
        raise RuntimeError(f"the arms generated different outputs: {digests}")
    base = arms.get("before", arms["streamed"])
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "workload": {"requests": args.requests, "rounds": args.rounds, "threads": args.threads, **PARAMS,
                     "model": "tiny random llama (tests/tiny_models.py)"},
        "commits": {"after": git_commit(after_checkout), **({"before": git_commit(pathlib.Path(args.before))}
                                                          if args.before else {})},
        "cpu_flags": cpu_flags(),
        "load_average": os.getloadavg(),
        "arms": arms,
        "ratio_vs": "before" if args.before else "streamed",
        "engine_cpu_ratio": arms["after"]["engine_us_per_token"] / base["engine_us_per_token"],
        "scheduler_cpu_ratio": arms["after"]["scheduler_us_per_token"] / base["scheduler_us_per_token"],
    }


def print_report(report: dict) -> None:
    print(f"{report['workload']['requests']} concurrent greedy requests x {PARAMS['max_new_tokens']} tokens, "
          f"median of {report['workload']['rounds']} rounds; load average {report['load_average']}, "
          f"CPU flags {report['cpu_flags'] or 'none'}")
    print(f"{'arm':<10} {'engine us/token':>16} {'scheduler us/token':>19} {'wall s':>8}")
    for name, arm in report["arms"].items():
        print(f"{name:<10} {arm['engine_us_per_token']:>16.1f} {arm['scheduler_us_per_token']:>19.1f} "
              f"{arm['wall_seconds']:>8.2f}")
    print(f"after / {report['ratio_vs']}: engine CPU x{report['engine_cpu_ratio']:.3f}, "
          f"scheduler CPU x{report['scheduler_cpu_ratio']:.3f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a furcate checkout to compare against (e.g. the main branch's)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per arm, the arms taking turns")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the scheduler")
    parser.add_argument("--output", default=str(HERE.parent / "results" / "engine_overhead.json"))
    parser.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)  # internal: run one arm here
    parser.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.model_dir, args.requests, args.stream, args.threads)))
        return
    report = compare(args)
    print_report(report)
    pathlib.Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
