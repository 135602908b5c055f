"""furcate, llama.cpp, vLLM (its CPU build) and HF transformers side by side on CPU: same weights, same thread
count, one run.

Each (system, precision) runs in its own process, one after another, through three workloads:
  offline        32 chat prompts of 20-400 tokens, 64 greedy output tokens each, all submitted at once
  decode_b1      one ~120-token prompt, decode tokens/s at batch 1 (time of 129 tokens minus time of 1)
  shared_prefix  4 groups x 8 prompts, a 512-token system prompt per group, 32-token questions, 32 tokens out

furcate runs twice: with its defaults, and as furcate-compiled with enable_torch_compile=True (decode graphs
compiled at start-up when none are saved; its start-up, compile included, is in the report). With the defaults, an
engine that finds no saved graphs decodes eagerly while a background process builds them: the defaults' worker waits
for them before timing, and reports whether they were loaded at start or after how long they arrived. Precision
pairs: float32 (llama.cpp: an F32 GGUF), bfloat16 (a BF16 GGUF) and quantized (furcate's defaults on the model's Q4
GGUF: the quantized kernels for small batches; llama.cpp: that same file). The float GGUFs are the Q4 GGUF's weights
dequantized, so every system holds the same numbers. llama.cpp runs batched on its low-level API (peer_llama_cpp.py)
and shares each group's system prompt through its KV cells; vLLM (peer_vllm.py, run with its own venv's interpreter)
gets the prompts as token ids with prefix caching on and otherwise its defaults; HF runs static left-padded batches
of 16 without prefix sharing. vLLM and HF load furcate's HF-directory conversion of the GGUF, in float32 and
bfloat16 only: neither has kernels for GGUF Q4_0/Q4_1 blocks.

Models (--model-shape): 135m, the embedded SmolLM2-135M-Instruct (Q4_1); 1b, a Llama-3.2-1B-shaped model with
random weights built once into the bench cache (peer_models.py; Q4_0, or Q4_1 with --quant-type), reported in
peers_1b.*. Each report also carries the CPU flags, the load average before the run, the CPU time other
processes took during each timing, a memory bandwidth probe, and for decode_b1 the share of that bandwidth each
system reached reading its weights once per token; for the batched workloads in float32 and bfloat16, the share of
the matmul ceiling each system reached (peers_roofline.py). --quick shrinks every workload to a smoke test.

    python -m benchmarks.peers [--model-shape 135m|1b] [--threads 2] [--precisions float32,bfloat16,quantized]
                               [--systems furcate,furcate-compiled,llama.cpp,vllm,hf] [--vllm-python PATH] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import time

from .peers_report import (
    COMPILED,
    MAX_TOKENS,
    SYSTEMS,
    aims,
    bandwidth_shares,
    compare,
    cpu_flags,
    defaults_aims,
    gguf_facts,
    markdown,
    measured,
    memory_bandwidth,
    plot,
    step_bytes,
)
from .peers_roofline import ceilings, machine_rates, model_facts, shares
from .perf_profile import VARIABLE as PERF_VARIABLE

RESULTS = pathlib.Path(__file__).parent / "results"
REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parents[1]  # where `python -m benchmarks.peers` resolves
BENCH_CACHE = pathlib.Path(os.environ.get("FURCATE_CACHE") or "~/.cache/furcate").expanduser() / "bench"
DEFAULT_VLLM_PYTHON = pathlib.Path("/work/vllm_venv/bin/python")
# Per precision: furcate's engine arguments, the GGUF llama.cpp reads ("source": the model's own Q4 file) and
# the dtype vLLM and HF load the HF directory in (None: no such row).
PRECISIONS = {
    "float32": {"furcate": {"dtype": "float32", "quantization": "none"}, "llama.cpp": "F32", "vllm": "float32",
                "hf": "float32"},
    "bfloat16": {"furcate": {"dtype": "bfloat16", "quantization": "none"}, "llama.cpp": "BF16", "vllm": "bfloat16",
                 "hf": "bfloat16"},
    "quantized": {"furcate": {}, "llama.cpp": "source", "vllm": None, "hf": None},
}
SIZES = {"offline": {"num_prompts": 32, "prompt_range": (20, 400), "output_len": 64, "seed": 0},
         "decode_b1": {"prompt_len": 120, "output_len": 128},
         "shared_prefix": {"groups": 4, "per_group": 8, "system_len": 512, "question_len": 32, "output_len": 32,
                           "seed": 1}}
QUICK_SIZES = {"offline": {"num_prompts": 4, "prompt_range": (20, 100), "output_len": 8, "seed": 0},
               "decode_b1": {"prompt_len": 32, "output_len": 8},
               "shared_prefix": {"groups": 2, "per_group": 2, "system_len": 64, "question_len": 8, "output_len": 8,
                                 "seed": 1}}
HF_BATCH = 16


def most_sequences(sizes: dict) -> int:
    """The most requests a batched workload runs at once."""
    return max(sizes["offline"]["num_prompts"], sizes["shared_prefix"]["groups"] * sizes["shared_prefix"]["per_group"])


def build_workloads(tokenizer, sizes: dict) -> dict:
    from .offline_throughput import build_prompt, build_workload
    from .shared_prefix import build_workload as shared_workload

    offline, decode, shared = sizes["offline"], sizes["decode_b1"], sizes["shared_prefix"]
    prompts = build_workload(tokenizer, offline["num_prompts"], offline["seed"], tuple(offline["prompt_range"]),
                             (offline["output_len"], offline["output_len"])).prompts
    return {"offline": prompts,
            "decode_b1": build_prompt(tokenizer, random.Random(7), decode["prompt_len"]),
            "shared_prefix": shared_workload(tokenizer, shared["groups"], shared["per_group"], shared["system_len"],
                                             shared["question_len"], shared["seed"])}


# --- workers: each runs in its own process -------------------------------------------------------------------

def timed(fn, label: str | None):
    """fn's value, its wall seconds and the CPU seconds other processes took meanwhile; recorded by perf under
    label where FURCATE_BENCH_PERF asks (perf_profile.py)."""
    from .offline_throughput import CpuMeter
    from .perf_profile import recording

    meter = CpuMeter()  # before perf starts: perf's own CPU counts as another process's
    with recording(label):
        started = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - started
    return value, seconds, meter.foreign_seconds()


def furcate_worker(spec: dict, workloads: dict) -> dict:
    from furcate import Engine

    threads, sizes, results = spec["threads"], spec["sizes"], {}
    extra = {**spec["furcate_args"], **({"enable_torch_compile": True} if spec["system"] == COMPILED else {})}
    started = time.perf_counter()
    with Engine(spec["furcate_model"], torch_num_threads=threads, max_total_tokens=MAX_TOKENS,
                max_running_requests=64, **PRECISIONS[spec["precision"]]["furcate"], **extra) as engine:
        results["engine"] = {"dtype": engine.info.dtype, "quantized_layers": engine.info.quantized_layers,
                             "quantized_max_rows": engine.info.quantized_max_rows,
                             "start_seconds": round(time.perf_counter() - started, 1), **extra}
        if spec["system"] == "furcate" and not spec.get("first_run"):
            results["engine"]["decode_graphs"] = wait_for_graphs(engine, workloads["decode_b1"], started)

        def run(prompts: list[list[int]], n: int) -> list[list[int]]:
            params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
            return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]

        run(workloads["offline"][:2], 4)
        for name in ("offline", "shared_prefix"):
            n = sizes[name]["output_len"]
            assert engine.flush_cache()
            outputs, seconds, foreign = timed(lambda name=name, n=n: run(workloads[name], n), label(spec, name))
            results[name] = summary(outputs, seconds, foreign)

        def decode(n: int) -> list[list[int]]:
            assert engine.flush_cache()  # the prompt is prefilled in both timings
            return run([workloads["decode_b1"]], n)
        results["decode_b1"] = decode_summary(decode, sizes["decode_b1"]["output_len"], label(spec, "decode_b1"))
        if spec.get("first_run"):  # whether compiled graphs arrived during the timed runs
            results["engine"]["compiled_forward_calls"] = engine.get_stats()["compiled_forward_calls"]
    return results


def wait_for_graphs(engine, prompt: list[int], started: float, limit_s: float = 900) -> str:
    """Decode a few tokens until they run through compiled graphs: at once when saved graphs were loaded at start,
    else once the background build delivers them; how it went, for the report."""
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    for probe in range(10**6):
        engine.generate(input_ids=[prompt], sampling_params=params)
        if engine.get_stats()["compiled_forward_calls"]:
            waited = time.perf_counter() - started
            return "loaded at start" if probe == 0 else f"built in the background, serving from {waited:.0f} s"
        if time.perf_counter() - started > limit_s:
            break
        time.sleep(5)
    return f"none after {limit_s:.0f} s: eager"


def llama_worker(spec: dict, workloads: dict) -> dict:
    from .peer_llama_cpp import LlamaCppBatched

    sizes = spec["sizes"]
    n_seq = most_sequences(sizes)
    runner = LlamaCppBatched(spec["gguf"], spec["threads"], MAX_TOKENS, n_seq=n_seq)
    results = {"engine": {"gguf": pathlib.Path(spec["gguf"]).name, "use_extra_bufts": runner.extra_bufts}}
    try:
        runner.generate(workloads["offline"][:2], 4)
        n = sizes["offline"]["output_len"]
        outputs, seconds, foreign = timed(lambda: runner.generate(workloads["offline"], n), label(spec, "offline"))
        results["offline"] = summary(outputs, seconds, foreign)
        order, shared = group_order(workloads["shared_prefix"], sizes["shared_prefix"]["system_len"])
        prompts = [workloads["shared_prefix"][i] for i in order]
        n = sizes["shared_prefix"]["output_len"]
        grouped, seconds, foreign = timed(lambda: runner.generate(prompts, n, shared), label(spec, "shared_prefix"))
        outputs = [None] * len(order)
        for position, i in enumerate(order):
            outputs[i] = grouped[position]
        results["shared_prefix"] = summary(outputs, seconds, foreign)
        results["decode_b1"] = decode_summary(lambda n: runner.generate([workloads["decode_b1"]], n),
                                              sizes["decode_b1"]["output_len"], label(spec, "decode_b1"))
    finally:
        runner.close()
    return results


def hf_worker(spec: dict, workloads: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from .offline_throughput import hf_generate

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, PRECISIONS[spec["precision"]]["hf"])
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=dtype).eval()
    pad, sizes = model.generation_config.pad_token_id, spec["sizes"]
    results = {"engine": {"dtype": str(dtype).removeprefix("torch."), "batch_size": HF_BATCH}}

    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        with torch.inference_mode():
            return [row for start in range(0, len(prompts), HF_BATCH)
                    for row in hf_generate(model, prompts[start : start + HF_BATCH], n, pad)]

    run(workloads["offline"][:2], 4)
    for name in ("offline", "shared_prefix"):
        n = sizes[name]["output_len"]
        outputs, seconds, foreign = timed(lambda name=name, n=n: run(workloads[name], n), label(spec, name))
        results[name] = summary(outputs, seconds, foreign)
    results["decode_b1"] = decode_summary(lambda n: run([workloads["decode_b1"]], n), sizes["decode_b1"]["output_len"],
                                          label(spec, "decode_b1"))
    return results


def summary(outputs: list[list[int]], seconds: float, foreign: float) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "output_tok_s": tokens / seconds, "foreign_cpu_seconds": foreign,
            "outputs": outputs}


def label(spec: dict, workload: str) -> str:
    """A timed run's name in perf recordings: system, precision, workload."""
    return f"{spec['system']}-{spec['precision']}-{workload}"


def decode_summary(generate, n: int, name: str) -> dict:
    """Decode tokens/s at batch 1: (n+1-token run - 1-token run) / n, best of two pairs (perf records the
    (n+1)-token runs under name, the second over the first)."""
    generate(2)
    rates, outputs, foreign_total = [], None, 0.0
    for _ in range(2):
        _, first, foreign_a = timed(lambda: generate(1), None)
        outputs, full, foreign_b = timed(lambda: generate(n + 1), name)
        rates.append(n / (full - first))
        foreign_total += foreign_a + foreign_b
    return {"output_tok_s": max(rates), "rates": rates, "foreign_cpu_seconds": foreign_total, "outputs": outputs}


def group_order(prompts: list[list[int]], length: int) -> tuple[list[int], list[int]]:
    """The shared-prefix prompts grouped by system prompt (the group's first prompt first) and, per position,
    how many tokens it shares with its group: what llama.cpp's seq_cp needs spelled out."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt[:length]), []).append(i)
    order = [i for members in groups.values() for i in members]
    return order, [length] * len(order)


WORKERS = {"furcate": furcate_worker, COMPILED: furcate_worker, "llama.cpp": llama_worker, "hf": hf_worker}


def worker_main(spec: dict) -> None:
    workloads = json.loads(pathlib.Path(spec["workloads"]).read_text())
    result = WORKERS[spec["system"]](spec, workloads)
    pathlib.Path(spec["output"]).write_text(json.dumps(result))


# --- models and machine facts ------------------------------------------------------------------------------------

def prepare_models(shape: str, quant_type: str) -> dict:
    """The GGUFs llama.cpp reads (source Q4, F32, BF16), what furcate is given, and the HF directory vLLM and HF
    load: furcate's own conversion of the source GGUF, so all of them hold one set of weights."""
    from furcate.runtime.model.weights.checkpoint import resolve_model_path
    from furcate.runtime.model.weights.default_model import find_default_gguf

    from .peer_llama_cpp import write_gguf_copy
    from .peer_models import SHAPE_1B, write_random_gguf

    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    if shape == "135m":
        source, furcate_model, name = find_default_gguf(), "default", "SmolLM2-135M-Instruct"
    else:
        target = BENCH_CACHE / "models" / f"llama-3.2-1b-shape-random.{quant_type}.gguf"
        print(f"preparing {target.name} (built once)", flush=True)
        source = write_random_gguf(target, find_default_gguf(), SHAPE_1B, quant_type)
        furcate_model, name = str(source), f"Llama-3.2-1B-shaped, random weights, {quant_type}"
    ggufs = {"source": str(source)}
    stem = source.stem.rsplit(".", 1)[0]
    for precision in ("F32", "BF16"):
        target = (BENCH_CACHE if shape == "135m" else BENCH_CACHE / "models") / f"{stem}.{precision}.gguf"
        ggufs[precision] = str(write_gguf_copy(source, target, precision))
    return {"name": name, "ggufs": ggufs, "furcate_model": furcate_model,
            "hf_dir": resolve_model_path(furcate_model)}


def run_worker(spec: dict, workloads_file: pathlib.Path) -> dict:
    """One (system, precision) in its own process; with spec["first_run"], furcate in an empty cache folder (its
    kernels built, choices measured, model converted and decode graphs compiled as on a fresh machine)."""
    output = workloads_file.with_name(f"{spec['system']}-{spec['precision']}.json")
    spec = {**spec, "workloads": str(workloads_file), "output": str(output)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="furcate-first-run-") as fresh:
        env = os.environ | ({"FURCATE_CACHE": fresh} if spec.get("first_run") else {})
        subprocess.run([sys.executable, "-m", "benchmarks.peers", "--worker", json.dumps(spec)], check=True,
                       cwd=REPOSITORY_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    result = json.loads(output.read_text())
    print(f"  {spec['system']} {spec['precision']}: done in {time.perf_counter() - started:.0f}s", flush=True)
    return result


def vllm_python(given: str | None) -> str | None:
    """--vllm-python, else FURCATE_VLLM_PYTHON, else /work/vllm_venv/bin/python; None if it cannot import vllm."""
    python = given or os.environ.get("FURCATE_VLLM_PYTHON") or (str(DEFAULT_VLLM_PYTHON)
                                                                if DEFAULT_VLLM_PYTHON.exists() else None)
    if python is None:
        return None
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, cwd="/")
    return python if probe.returncode == 0 else None


def vllm_preload(python: str) -> str:
    """TCMalloc and the venv's Intel OpenMP, preloaded as vLLM's CPU docs set it up (its worker warns that
    performance suffers without them); whichever of the two is present."""
    candidates = [pathlib.Path(f"/{lib}/x86_64-linux-gnu/libtcmalloc_minimal.so.4") for lib in ("lib", "usr/lib")]
    tcmalloc = next((str(path) for path in candidates if path.exists()), None)
    iomp = pathlib.Path(python).parents[1] / "lib" / "libiomp5.so"
    return ":".join(lib for lib in (tcmalloc, str(iomp) if iomp.exists() else None) if lib)


def vllm_settings(python: str, models: dict, precision: str, threads: int) -> dict:
    """What the vLLM worker is given: the cores its OpenMP threads are bound to (the first `threads` this
    process may run on; an explicit list, since vLLM's default "auto" binds one core fewer than the NUMA node
    has, reserving one for its engine-core process), and a KV cache of MAX_TOKENS tokens in bytes (the
    VLLM_CPU_KVCACHE_SPACE variable takes whole GiB and is legacy in this version, kv_cache_memory_bytes is
    exact) with max_model_len cut to half of it where the model allows more (Llama 3.2's 131072 would not fit,
    and vLLM keeps a block of the cache to itself, so a request of all 24576 tokens would not either);
    LD_PRELOAD as vllm_preload."""
    fields = gguf_facts(models["ggufs"]["source"])["fields"]
    head_dim = fields["llama.embedding_length"] // fields["llama.attention.head_count"]
    per_token = 2 * fields["llama.block_count"] * fields["llama.attention.head_count_kv"] * head_dim
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores)}
    if preload := vllm_preload(python):
        env["LD_PRELOAD"] = preload
    return {"env": env,
            "kv_cache_bytes": MAX_TOKENS * per_token * (4 if precision == "float32" else 2),
            "max_model_len": min(fields["llama.context_length"], MAX_TOKENS // 2)}


def run_vllm(python: str, spec: dict, workloads_file: pathlib.Path, settings: dict) -> dict:
    """The vLLM worker under its own interpreter, without furcate on its path; its log goes to the bench cache.
    A failure becomes the row's status rather than ending the whole run."""
    output = workloads_file.with_name(f"vllm-{spec['precision']}.json")
    log = output.with_suffix(".log")
    spec = {**spec, "workloads": str(workloads_file), "output": str(output), "model_dir": spec["hf_dir"],
            "dtype": PRECISIONS[spec["precision"]]["vllm"], "kv_cache_bytes": settings["kv_cache_bytes"],
            "max_model_len": settings["max_model_len"]}
    spec_file = output.with_suffix(".spec.json")
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | settings["env"]
    started = time.perf_counter()
    with open(log, "w") as sink:
        done = subprocess.run([python, "-m", "benchmarks.peer_vllm", str(spec_file)], cwd=REPOSITORY_ROOT, env=env,
                              stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        print(f"  vllm {spec['precision']}: failed, see {log}", flush=True)
        return {"status": f"failed: {lines[-1][:200] if lines else done.returncode}", "log": str(log)}
    print(f"  vllm {spec['precision']}: done in {time.perf_counter() - started:.0f}s", flush=True)
    return json.loads(output.read_text()) | {"settings": settings}


# --- the report --------------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--model-shape", choices=("135m", "1b"), default="135m")
    parser.add_argument("--quant-type", choices=("Q4_0", "Q4_1"), default="Q4_0", help="the 1b model's GGUF type")
    parser.add_argument("--vllm-python", help="interpreter with vllm installed (default: $FURCATE_VLLM_PYTHON, "
                                              f"else {DEFAULT_VLLM_PYTHON})")
    parser.add_argument("--furcate-args", default="{}",
                        help='engine arguments added to furcate\'s, as JSON: \'{"enable_torch_compile": true}\'')
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (4 prompts, 8 output tokens)")
    parser.add_argument("--first-run", action="store_true",
                        help="furcate as on a fresh machine: an empty cache, timed without waiting for its graphs")
    parser.add_argument("--hold-to-avx2", action="store_true",
                        help="emulate a CPU without AVX-512 on one that has it (hold_to_avx2)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--output", help="report path (default results/peers[_1b].json; with --quick in the bench "
                                         "cache, never over a real report)")
    return parser.parse_args()


def default_output(args: argparse.Namespace) -> pathlib.Path:
    name = "peers" + ("_1b" if args.model_shape == "1b" else "")
    return BENCH_CACHE / f"{name}_quick.json" if args.quick else RESULTS / f"{name}.json"


# What holds every system to AVX2 on a CPU with AVX-512: torch's kernels (and inductor's), oneDNN's, MKL's and
# furcate's own builds. llama.cpp must be built so (GGML_NATIVE=OFF, GGML_AVX512=OFF); vLLM is told it has no AVX-512.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "FURCATE_NATIVE_FLAGS": "-mno-avx512f -mno-avxvnni -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"}
VLLM_WITHOUT_AVX512 = """import torch.cpu
# benchmarks.peers --hold-to-avx2: vLLM loads its AVX2 kernels (_C_AVX2) as on a CPU without AVX-512.
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


VLLM_WITHOUT_AVX512_DIR = BENCH_CACHE / "vllm-without-avx512"


def hold_to_avx2() -> None:
    """Set AVX2_ENV for every worker, and write the sitecustomize that tells vLLM's processes there is no AVX-512
    (on the vLLM rows' PYTHONPATH). Refuses a llama.cpp built with AVX-512."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    if re.search(r"AVX512\w* = 1", info):
        raise SystemExit(f"--hold-to-avx2: this llama-cpp-python uses AVX-512 ({info.strip()}); rebuild it with "
                         'CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX512=OFF"')
    os.environ.update(AVX2_ENV)
    folder = VLLM_WITHOUT_AVX512_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(VLLM_WITHOUT_AVX512)


def run_all(args: argparse.Namespace, models: dict, workloads_file: pathlib.Path, sizes: dict) -> tuple[dict, dict]:
    """Every (precision, system) in turn; the results and the vLLM settings used."""
    python = vllm_python(args.vllm_python) if "vllm" in args.systems.split(",") else None
    results: dict = {}
    settings: dict = {}
    for precision in args.precisions.split(","):
        results[precision] = {}
        for system in args.systems.split(","):
            if system in ("hf", "vllm") and PRECISIONS[precision][system] is None:
                continue
            spec = {"system": system, "precision": precision, "threads": args.threads, "sizes": sizes,
                    "furcate_model": models["furcate_model"], "hf_dir": models["hf_dir"],
                    "furcate_args": json.loads(args.furcate_args), "first_run": args.first_run,
                    "gguf": models["ggufs"][PRECISIONS[precision]["llama.cpp"]]}
            if system == "vllm" and python is None:
                results[precision][system] = {"status": "not installed"}
            elif system == "vllm":
                settings[precision] = vllm_settings(python, models, precision, args.threads)
                if args.hold_to_avx2:
                    settings[precision]["env"]["PYTHONPATH"] = str(VLLM_WITHOUT_AVX512_DIR)
                results[precision][system] = run_vllm(python, spec, workloads_file, settings[precision])
            else:
                results[precision][system] = run_worker(spec, workloads_file)
    return results, settings


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker_main(json.loads(args.worker))

    import llama_cpp
    import torch
    import transformers
    from transformers import AutoTokenizer

    import furcate

    if args.hold_to_avx2:
        hold_to_avx2()
    if os.environ.get(PERF_VARIABLE):  # oneDNN's JIT kernels named in perf's reports (a perf map per process)
        os.environ.update({"ONEDNN_JIT_PROFILE": "2", "DNNL_JIT_PROFILE": "2"})
    load_before = os.getloadavg()
    sizes = QUICK_SIZES if args.quick else SIZES
    models = prepare_models(args.model_shape, args.quant_type)
    bandwidth = memory_bandwidth(args.threads)
    print(f"memory bandwidth: read {bandwidth['read_gb_s']:.1f} GB/s, copy {bandwidth['copy_gb_s']:.1f} GB/s",
          flush=True)
    workloads = build_workloads(AutoTokenizer.from_pretrained(models["hf_dir"]), sizes)
    facts = model_facts(models["hf_dir"])
    rates = machine_rates(facts, most_sequences(sizes), args.threads, args.precisions.split(","))
    print(f"matmul GFLOP/s: {json.dumps(rates)}", flush=True)
    workloads_file = BENCH_CACHE / "peers-workloads.json"
    workloads_file.write_text(json.dumps(workloads))
    results, settings = run_all(args, models, workloads_file, sizes)
    for precision, systems in results.items():
        engine = systems.get("furcate", {}).get("engine", {})
        if precision == "quantized" and engine.get("quantized_layers") == 0:
            print("WARNING: furcate ran no quantized layers (this CPU has no native bfloat16: auto means dense)")
    table = compare(results)
    ceiling = ceilings(workloads, sizes, facts, rates)
    vllm_version = next((r["engine"]["version"] for s in results.values() for n, r in s.items()
                         if n == "vllm" and measured(r)), None)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": models["name"],
              "model_shape": args.model_shape, "quick": args.quick, "threads": args.threads,
              "held_to_avx2": AVX2_ENV if args.hold_to_avx2 else None, "first_run": args.first_run,
              "furcate_args": json.loads(args.furcate_args),
              "load_before": [round(x, 2) for x in load_before], "cpu_flags": cpu_flags(), "bandwidth": bandwidth,
              "versions": {"furcate": furcate.__version__, "llama_cpp": llama_cpp.__version__, "vllm": vllm_version,
                           "transformers": transformers.__version__, "torch": torch.__version__},
              "vllm_settings": settings,
              "engines": {p: {s: r.get("engine", r.get("status")) for s, r in systems.items()}
                          for p, systems in results.items()},
              "table": table, "aims": aims(table), "defaults_aims": defaults_aims(table),
              "decode_bandwidth": bandwidth_shares(results, step_bytes(models), bandwidth), "sizes": sizes,
              "matmul_rates": rates, "ceiling": ceiling, "ceiling_shares": shares(table, ceiling)}
    output = pathlib.Path(args.output) if args.output else default_output(args)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    output.with_suffix(".md").write_text(markdown(report))
    plot(report, output.with_suffix(".png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
