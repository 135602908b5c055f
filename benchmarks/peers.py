"""furcate, llama.cpp and HF transformers side by side on CPU: same weights, same thread count, one run.

Each (system, precision) runs in its own process, one after another, through three workloads:
  offline        32 chat prompts of 20-400 tokens, 64 greedy output tokens each, all submitted at once
  decode_b1      one ~120-token prompt, decode tokens/s at batch 1 (time of 129 tokens minus time of 1)
  shared_prefix  4 groups x 8 prompts, a 512-token system prompt per group, 32-token questions, 32 tokens out

Precision pairs: float32 (llama.cpp: an F32 GGUF), bfloat16 (a BF16 GGUF) and quantized (furcate's defaults on
the embedded Q4_1 GGUF: int4 kernels for small batches; llama.cpp: that same file). The float GGUFs are the
embedded GGUF's weights dequantized, so all three systems hold the same numbers. llama.cpp runs batched on its
low-level API (peer_llama_cpp.py) and shares each group's system prompt through its KV cells; HF runs static
left-padded batches of 16 without prefix sharing, in float32 and bfloat16 only (it has no Q4_1 kernels).

    python -m benchmarks.peers [--threads 2] [--precisions float32,bfloat16,quantized]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import random
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results"
REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parents[1]  # where `python -m benchmarks.peers` resolves
BENCH_CACHE = pathlib.Path(os.environ.get("FURCATE_CACHE") or "~/.cache/furcate").expanduser() / "bench"
SYSTEMS = ("furcate", "llama.cpp", "hf")
PRECISIONS = {
    "float32": {"furcate": {"dtype": "float32", "quantization": "none"}, "llama.cpp": "F32", "hf": "float32"},
    "bfloat16": {"furcate": {"dtype": "bfloat16", "quantization": "none"}, "llama.cpp": "BF16", "hf": "bfloat16"},
    "quantized": {"furcate": {}, "llama.cpp": "Q4_1", "hf": None},
}
OFFLINE = {"num_prompts": 32, "prompt_range": (20, 400), "output_len": 64, "seed": 0}
DECODE = {"prompt_len": 120, "output_len": 128}
SHARED = {"groups": 4, "per_group": 8, "system_len": 512, "question_len": 32, "output_len": 32, "seed": 1}
HF_BATCH = 16
MAX_TOKENS = 24576  # KV capacity every system gets (furcate pool tokens, llama.cpp n_ctx)


def build_workloads(tokenizer) -> dict:
    from .offline_throughput import build_prompt, build_workload
    from .shared_prefix import build_workload as shared_workload

    offline = build_workload(tokenizer, OFFLINE["num_prompts"], OFFLINE["seed"], OFFLINE["prompt_range"],
                             (OFFLINE["output_len"], OFFLINE["output_len"]))
    decode = build_prompt(tokenizer, random.Random(7), DECODE["prompt_len"])
    shared = shared_workload(tokenizer, SHARED["groups"], SHARED["per_group"], SHARED["system_len"],
                             SHARED["question_len"], SHARED["seed"])
    return {"offline": offline.prompts, "decode_b1": decode, "shared_prefix": shared}


# --- workers: each runs in its own process -------------------------------------------------------------------

def timed(fn):
    from .offline_throughput import CpuMeter

    meter, started = CpuMeter(), time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started, meter.foreign_seconds()


def furcate_worker(spec: dict, workloads: dict) -> dict:
    from furcate import Engine

    threads, results = spec["threads"], {}
    with Engine("default", torch_num_threads=threads, max_total_tokens=MAX_TOKENS, max_running_requests=64,
                **PRECISIONS[spec["precision"]]["furcate"]) as engine:
        results["engine"] = {"dtype": engine.info.dtype, "quantized_layers": engine.info.quantized_layers}

        def run(prompts: list[list[int]], n: int) -> list[list[int]]:
            params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
            return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]

        run(workloads["offline"][:2], 4)
        for name, n in (("offline", OFFLINE["output_len"]), ("shared_prefix", SHARED["output_len"])):
            assert engine.flush_cache()
            outputs, seconds, foreign = timed(lambda name=name, n=n: run(workloads[name], n))
            results[name] = summary(outputs, seconds, foreign)

        def decode(n: int) -> list[list[int]]:
            assert engine.flush_cache()  # the prompt is prefilled in both timings
            return run([workloads["decode_b1"]], n)
        results["decode_b1"] = decode_summary(decode)
    return results


def llama_worker(spec: dict, workloads: dict) -> dict:
    from .peer_llama_cpp import LlamaCppBatched

    runner = LlamaCppBatched(spec["gguf"], spec["threads"], MAX_TOKENS, n_seq=OFFLINE["num_prompts"])
    results = {"engine": {"gguf": pathlib.Path(spec["gguf"]).name}}
    try:
        runner.generate(workloads["offline"][:2], 4)
        outputs, seconds, foreign = timed(lambda: runner.generate(workloads["offline"], OFFLINE["output_len"]))
        results["offline"] = summary(outputs, seconds, foreign)
        order, shared = group_order(workloads["shared_prefix"])
        prompts = [workloads["shared_prefix"][i] for i in order]
        grouped, seconds, foreign = timed(lambda: runner.generate(prompts, SHARED["output_len"], shared))
        outputs = [None] * len(order)
        for position, i in enumerate(order):
            outputs[i] = grouped[position]
        results["shared_prefix"] = summary(outputs, seconds, foreign)
        results["decode_b1"] = decode_summary(lambda n: runner.generate([workloads["decode_b1"]], n))
    finally:
        runner.close()
    return results


def hf_worker(spec: dict, workloads: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from furcate.runtime.model.loader import resolve_model_path

    from .offline_throughput import hf_generate

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, PRECISIONS[spec["precision"]]["hf"])
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("default"), dtype=dtype).eval()
    pad = model.generation_config.pad_token_id
    results = {"engine": {"dtype": str(dtype).removeprefix("torch."), "batch_size": HF_BATCH}}

    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        with torch.inference_mode():
            return [row for start in range(0, len(prompts), HF_BATCH)
                    for row in hf_generate(model, prompts[start : start + HF_BATCH], n, pad)]

    run(workloads["offline"][:2], 4)
    for name, n in (("offline", OFFLINE["output_len"]), ("shared_prefix", SHARED["output_len"])):
        outputs, seconds, foreign = timed(lambda name=name, n=n: run(workloads[name], n))
        results[name] = summary(outputs, seconds, foreign)
    results["decode_b1"] = decode_summary(lambda n: run([workloads["decode_b1"]], n))
    return results


def summary(outputs: list[list[int]], seconds: float, foreign: float) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "output_tok_s": tokens / seconds, "foreign_cpu_seconds": foreign,
            "outputs": outputs}


def decode_summary(generate) -> dict:
    """Decode tokens/s at batch 1: (129-token run - 1-token run) / 128, best of two pairs."""
    n = DECODE["output_len"]
    generate(2)
    rates, outputs, foreign_total = [], None, 0.0
    for _ in range(2):
        _, first, foreign_a = timed(lambda: generate(1))
        outputs, full, foreign_b = timed(lambda: generate(n + 1))
        rates.append(n / (full - first))
        foreign_total += foreign_a + foreign_b
    return {"output_tok_s": max(rates), "rates": rates, "foreign_cpu_seconds": foreign_total, "outputs": outputs}


def group_order(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """The shared-prefix prompts grouped by system prompt (the group's first prompt first) and, per position,
    how many tokens it shares with its group: what llama.cpp's seq_cp needs spelled out."""
    length = SHARED["system_len"]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt[:length]), []).append(i)
    order = [i for members in groups.values() for i in members]
    return order, [length] * len(order)


WORKERS = {"furcate": furcate_worker, "llama.cpp": llama_worker, "hf": hf_worker}


def worker_main(spec: dict) -> None:
    workloads = json.loads(pathlib.Path(spec["workloads"]).read_text())
    result = WORKERS[spec["system"]](spec, workloads)
    pathlib.Path(spec["output"]).write_text(json.dumps(result))


# --- the driver ------------------------------------------------------------------------------------------------

def prepare_ggufs() -> dict[str, str]:
    from furcate.runtime.model.default_model import find_default_gguf

    from .peer_llama_cpp import write_gguf_copy

    source = find_default_gguf()
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    paths = {"Q4_1": str(source)}
    for precision in ("F32", "BF16"):
        name = f"{source.stem.removesuffix('.Q4_1')}.{precision}.gguf"
        paths[precision] = str(write_gguf_copy(source, BENCH_CACHE / name, precision))
    return paths


def run_worker(system: str, precision: str, threads: int, workloads_file: pathlib.Path, gguf: str | None) -> dict:
    output = workloads_file.with_name(f"{system}-{precision}.json")
    spec = {"system": system, "precision": precision, "threads": threads, "workloads": str(workloads_file),
            "output": str(output), "gguf": gguf}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.peers", "--worker", json.dumps(spec)], check=True,
                   cwd=REPOSITORY_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads(output.read_text())
    print(f"  {system} {precision}: done in {time.perf_counter() - started:.0f}s", flush=True)
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of output positions before the two greedy outputs first differ."""
    same = sum(next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
               for ra, rb in zip(a, b))
    return same / sum(len(r) for r in a)


def compare(results: dict) -> dict:
    """Ratios furcate / peer per precision and workload, and output agreement with furcate."""
    table = {}
    for precision, systems in results.items():
        ours = systems.get("furcate")
        for workload in ("offline", "decode_b1", "shared_prefix"):
            row = {name: systems[name][workload]["output_tok_s"] for name in systems}
            for peer in ("llama.cpp", "hf"):
                if ours and peer in systems:
                    row[f"furcate/{peer}"] = ours[workload]["output_tok_s"] / systems[peer][workload]["output_tok_s"]
                    row[f"agreement_{peer}"] = agreement(ours[workload]["outputs"], systems[peer][workload]["outputs"])
            row["max_foreign_cpu_s"] = max(systems[name][workload]["foreign_cpu_seconds"] for name in systems)
            table[f"{precision}/{workload}"] = row
    return table


def aims(table: dict) -> dict:
    def get(key, column):
        return table.get(key, {}).get(column)

    return {
        "offline >= 1.2x llama.cpp (same precision)": {p: get(f"{p}/offline", "furcate/llama.cpp")
                                                       for p in PRECISIONS},
        "batch-1 decode >= 1.0x llama.cpp (same precision)": {p: get(f"{p}/decode_b1", "furcate/llama.cpp")
                                                              for p in PRECISIONS},
        ">= 3x HF generate (offline)": {p: get(f"{p}/offline", "furcate/hf") for p in ("float32", "bfloat16")},
    }


def markdown(report: dict) -> str:
    lines = [f"# CPU peers ({report['date']})", "",
             f"SmolLM2-135M-Instruct, {report['threads']} threads each, greedy; furcate "
             f"{report['versions']['furcate']}, llama-cpp-python {report['versions']['llama_cpp']}, transformers "
             f"{report['versions']['transformers']}, torch {report['versions']['torch']}. Load before the run: "
             f"{report['load_before']}.", "",
             "| precision / workload | furcate tok/s | llama.cpp tok/s | HF tok/s | furcate/llama.cpp | furcate/HF "
             "| agreement llama.cpp | agreement HF | foreign CPU s |", "|---|---|---|---|---|---|---|---|---|"]
    for key, row in report["table"].items():
        def cell(name, fmt="{:.1f}", row=row):
            return fmt.format(row[name]) if row.get(name) is not None else "-"
        lines.append(f"| {key} | {cell('furcate')} | {cell('llama.cpp')} | {cell('hf')} | "
                     f"{cell('furcate/llama.cpp', '{:.2f}x')} | {cell('furcate/hf', '{:.2f}x')} | "
                     f"{cell('agreement_llama.cpp', '{:.2f}')} | {cell('agreement_hf', '{:.2f}')} | "
                     f"{cell('max_foreign_cpu_s')} |")
    lines += ["", "## Aims", ""]
    for aim, values in report["aims"].items():
        shown = ", ".join(f"{p} {v:.2f}x" if v is not None else f"{p} -" for p, v in values.items())
        lines.append(f"- {aim}: {shown}")
    lines += ["", "Workloads: " + json.dumps({"offline": OFFLINE, "decode_b1": DECODE, "shared_prefix": SHARED}), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(RESULTS / "peers.json"))
    args = parser.parse_args()
    if args.worker:
        return worker_main(json.loads(args.worker))

    import llama_cpp
    import torch
    import transformers
    from transformers import AutoTokenizer

    import furcate
    from furcate.runtime.model.loader import resolve_model_path

    load_before = os.getloadavg()
    ggufs = prepare_ggufs()
    workloads = build_workloads(AutoTokenizer.from_pretrained(resolve_model_path("default")))
    workloads_file = BENCH_CACHE / "peers-workloads.json"
    workloads_file.write_text(json.dumps(workloads))
    results: dict = {}
    for precision in args.precisions.split(","):
        results[precision] = {}
        for system in args.systems.split(","):
            if system == "hf" and PRECISIONS[precision]["hf"] is None:
                continue
            gguf = ggufs[PRECISIONS[precision]["llama.cpp"]] if system == "llama.cpp" else None
            results[precision][system] = run_worker(system, precision, args.threads, workloads_file, gguf)
    table = compare(results)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "threads": args.threads, "load_before": [round(x, 2) for x in load_before],
              "versions": {"furcate": furcate.__version__, "llama_cpp": llama_cpp.__version__,
                           "transformers": transformers.__version__, "torch": torch.__version__},
              "engines": {p: {s: r["engine"] for s, r in systems.items()} for p, systems in results.items()},
              "table": table, "aims": aims(table)}
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    output.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
