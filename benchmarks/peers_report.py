"""The peers benchmark's measurements beside the workers and its report: the weight bytes a decode step reads,
the memory bandwidth probe, the comparison table, the aims, the markdown and the plot (benchmarks/peers.py)."""

from __future__ import annotations

import json
import pathlib
import time

from .peers_roofline import markdown_lines as ceiling_lines

COMPILED = "furcate-compiled"  # furcate with enable_torch_compile
SYSTEMS = ("furcate", COMPILED, "llama.cpp", "vllm", "hf")
OURS = ("furcate", COMPILED)
WORKLOADS = ("offline", "decode_b1", "shared_prefix")
PRECISION_NAMES = ("float32", "bfloat16", "quantized")
MAX_TOKENS = 24576  # KV capacity every system gets (furcate pool tokens, llama.cpp n_ctx, vLLM KV bytes)

def gguf_facts(path: str) -> dict:
    """Shape facts and the per-tensor sizes the bytes-per-step estimate needs."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {k: reader.fields[k].contents() for k in ("llama.block_count", "llama.attention.head_count",
                                                       "llama.attention.head_count_kv", "llama.embedding_length",
                                                       "llama.context_length")}
    names = {t.name for t in reader.tensors}
    # The embedding lookup reads one row per token; the table counts only where it doubles as the LM head.
    counted = [t for t in reader.tensors if not (t.name == "token_embd.weight" and "output.weight" in names)]
    return {"fields": fields, "tensors": [(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes))
                                          for t in counted]}


def step_bytes(models: dict) -> dict[str, dict[str, float]]:
    """Weight bytes one decode step reads, per precision and system: the GGUF tensor bytes for llama.cpp, params x
    element size for float weights, and for furcate quantized its block GEMV rows (the weights' bits, a float16
    scale per 32 and, for Q4_1 and Q4_K, a float16 offset per 32), bfloat16 for the rest."""
    source = gguf_facts(models["ggufs"]["source"])
    params = sum(n for _, _, n, _ in source["tensors"])
    bits_per_weight = {"Q4_0": 4.5, "Q4_1": 5, "Q4_K": 5, "Q8_0": 8.5}
    quantized = sum(n * bits_per_weight.get(kind, 16) / 8 for _, kind, n, _ in source["tensors"])
    llama = {p: sum(b for *_, b in gguf_facts(models["ggufs"][p])["tensors"]) for p in ("F32", "BF16", "source")}
    table = {"float32": 4 * params, "bfloat16": 2 * params}
    out = {p: {s: table[p] for s in (*OURS, "vllm", "hf")} for p in table}
    for precision, gguf in (("float32", "F32"), ("bfloat16", "BF16")):
        out[precision]["llama.cpp"] = llama[gguf]
    out["quantized"] = {"furcate": quantized, COMPILED: quantized, "llama.cpp": llama["source"]}
    return out


def memory_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> dict:
    """Best-of-N read (sum) and copy bandwidth over a 1 GiB float32 tensor with the benchmark's thread count;
    decode at batch 1 streams the weights once per token, so the read figure is its ceiling."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(int(gib * 2**30) // 4)
        b = torch.empty_like(a)
        read, copy = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            a.sum()
            read.append(time.perf_counter() - started)
            started = time.perf_counter()
            b.copy_(a)
            copy.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    nbytes = a.numel() * 4
    return {"read_gb_s": nbytes / min(read) / 1e9, "copy_gb_s": 2 * nbytes / min(copy) / 1e9, "threads": threads,
            "array_gib": gib, "repeats": repeats}


def cpu_flags() -> list[str]:
    """The native bfloat16 / AMX flags furcate's dtype and quantization defaults depend on."""
    text = pathlib.Path("/proc/cpuinfo").read_text()
    return sorted(flag for flag in ("avx512_bf16", "amx_tile") if f" {flag}" in text)


# --- running the workers -------------------------------------------------------------------------------------------

def measured(result: dict | None) -> bool:
    return bool(result) and "status" not in result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of output positions before the two greedy outputs first differ."""
    same = sum(next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
               for ra, rb in zip(a, b))
    return same / sum(len(r) for r in a)


def compare(results: dict) -> dict:
    """Ratios furcate / peer per precision and workload, and output agreement with furcate; a peer that did not
    run shows its status."""
    table = {}
    for precision, systems in results.items():
        for workload in WORKLOADS:
            row: dict = {}
            for name, result in systems.items():
                row[name] = result[workload]["output_tok_s"] if measured(result) else result["status"]
            for us in (name for name in OURS if measured(systems.get(name))):
                ours = systems[us][workload]
                for peer in ("llama.cpp", "vllm", "hf"):
                    if measured(systems.get(peer)):
                        theirs = systems[peer][workload]
                        row[f"{us}/{peer}"] = ours["output_tok_s"] / theirs["output_tok_s"]
                        row[f"agreement_{peer}" + ("" if us == "furcate" else f"_{us}")] = agreement(
                            ours["outputs"], theirs["outputs"])
            row["max_foreign_cpu_s"] = max((r[workload]["foreign_cpu_seconds"] for r in systems.values()
                                            if measured(r)), default=None)
            table[f"{precision}/{workload}"] = row
    return table


def bandwidth_shares(results: dict, bytes_per_step: dict, bandwidth: dict) -> dict:
    """decode_b1 per precision and system: weight bytes per token x tokens/s over the measured read bandwidth."""
    shares = {}
    for precision, systems in results.items():
        for name, result in systems.items():
            if measured(result) and name in bytes_per_step.get(precision, {}):
                rate, nbytes = result["decode_b1"]["output_tok_s"], bytes_per_step[precision][name]
                shares[f"{precision}/{name}"] = {"bytes_per_token": nbytes, "tok_s": rate,
                                                 "gb_s": nbytes * rate / 1e9,
                                                 "share": nbytes * rate / 1e9 / bandwidth["read_gb_s"]}
    return shares


def aims(table: dict) -> dict:
    def get(key, column):
        value = table.get(key, {}).get(column)
        return value if isinstance(value, float) else None

    floats, every = ("float32", "bfloat16"), PRECISION_NAMES
    wanted = [("offline >= 1.5x vLLM CPU", "offline", "vllm", 1.5, floats),
              ("shared-prefix >= 1.5x vLLM CPU", "shared_prefix", "vllm", 1.5, floats),
              ("offline >= 1.5x llama.cpp batched", "offline", "llama.cpp", 1.5, every),
              ("shared-prefix >= 1.5x llama.cpp batched", "shared_prefix", "llama.cpp", 1.5, every),
              ("batch-1 decode >= 1.0x llama.cpp", "decode_b1", "llama.cpp", 1.0, every),
              (">= 3x HF generate (offline)", "offline", "hf", 3.0, floats)]
    return {f"{aim} (same precision)": {"target": target,
                                        "values": {p: get(f"{p}/{workload}", f"furcate/{peer}") for p in precisions},
                                        "compiled": {p: get(f"{p}/{workload}", f"{COMPILED}/{peer}")
                                                     for p in precisions}}
            for aim, workload, peer, target, precisions in wanted}


# furcate's defaults (the quantized row: the model's own GGUF, dtype and kernels chosen on this CPU) against each
# peer at whichever precision it ran fastest: what a user choosing an engine would compare.
DEFAULTS_AIMS = (("offline >= 1.2x vLLM CPU", "offline", "vllm", 1.2),
                 ("offline >= 1.2x llama.cpp batched", "offline", "llama.cpp", 1.2),
                 ("shared-prefix >= 1.5x vLLM CPU", "shared_prefix", "vllm", 1.5),
                 ("batch-1 decode >= 1.2x llama.cpp", "decode_b1", "llama.cpp", 1.2))


def defaults_aims(table: dict) -> dict:
    """Per aim: furcate's defaults over the peer's best precision, that precision, and the target."""
    result = {}
    for aim, workload, peer, target in DEFAULTS_AIMS:
        ours = table.get(f"quantized/{workload}", {}).get("furcate")
        theirs = {p: table.get(f"{p}/{workload}", {}).get(peer) for p in PRECISION_NAMES}
        theirs = {p: v for p, v in theirs.items() if isinstance(v, float)}
        best = max(theirs, key=theirs.get) if theirs else None
        ratio = ours / theirs[best] if isinstance(ours, float) and best else None
        result[aim] = {"target": target, "ratio": ratio, "peer_precision": best}
    return result


def markdown(report: dict) -> str:
    versions, bandwidth = report["versions"], report["bandwidth"]
    lines = [f"# CPU peers: {report['model']} ({report['date']})", "",
             f"{report['threads']} threads each, greedy; furcate {versions['furcate']}, llama-cpp-python "
             f"{versions['llama_cpp']}, vLLM {versions.get('vllm') or '-'} (CPU build), transformers "
             f"{versions['transformers']}, torch {versions['torch']}. CPU flags: "
             f"{', '.join(report['cpu_flags']) or 'none of avx512_bf16/amx_tile'}. Load before the run: "
             f"{report['load_before']}. Memory bandwidth ({bandwidth['threads']} threads, "
             f"{bandwidth['array_gib']} GiB): read {bandwidth['read_gb_s']:.1f} GB/s, copy "
             f"{bandwidth['copy_gb_s']:.1f} GB/s.", ""]
    if report.get("held_to_avx2"):
        lines += ["**AVX2 emulation, not an AVX2-only CPU:** every system held to AVX2 on this CPU (llama.cpp built "
                  "without AVX-512, vLLM on its AVX2 kernels, and " + ", ".join(f"{k}={v}" for k, v in
                                                                             report["held_to_avx2"].items()) + ").",
                  ""]
    if report.get("first_run"):
        lines += ["**First run:** furcate started in an empty cache folder each time (kernels built, kernel choices "
                  "measured, the model converted, decode graphs compiled in the background) and was timed at once, "
                  "without waiting for its graphs.", ""]
    if report.get("furcate_args"):
        lines += [f"furcate ran with {json.dumps(report['furcate_args'])} beside its defaults.", ""]
    if report["quick"]:
        lines += ["**Quick smoke-test sizes: these numbers measure nothing.**", ""]
    lines += ["| precision / workload | furcate tok/s | compiled tok/s | llama.cpp tok/s | vLLM tok/s | HF tok/s "
              "| furcate/llama.cpp | compiled/llama.cpp | furcate/vLLM | compiled/vLLM | furcate/HF "
              "| agreement llama.cpp | agreement vLLM | agreement HF | foreign CPU s |",
              "|" + "---|" * 15]
    for key, row in report["table"].items():
        def cell(name, fmt="{:.1f}", row=row):
            value = row.get(name)
            return fmt.format(value) if isinstance(value, float) else (value or "-")
        ratio = "{:.2f}x"
        lines.append(f"| {key} | {cell('furcate')} | {cell(COMPILED)} | {cell('llama.cpp')} | {cell('vllm')} | "
                     f"{cell('hf')} | {cell('furcate/llama.cpp', ratio)} | {cell(f'{COMPILED}/llama.cpp', ratio)} | "
                     f"{cell('furcate/vllm', ratio)} | {cell(f'{COMPILED}/vllm', ratio)} | {cell('furcate/hf', ratio)} "
                     f"| {cell('agreement_llama.cpp', '{:.2f}')} | {cell('agreement_vllm', '{:.2f}')} | "
                     f"{cell('agreement_hf', '{:.2f}')} | {cell('max_foreign_cpu_s')} |")
    lines += ["", "## Aims (furcate's defaults; with enable_torch_compile)", ""]
    for aim, entry in report["aims"].items():
        def shown(values: dict, target: float = entry["target"]) -> str:
            return ", ".join(f"{p} {v:.2f}x {'met' if v >= target else 'missed'}" if v is not None else f"{p} -"
                             for p, v in values.items())
        lines.append(f"- {aim}: {shown(entry['values'])}; compiled: {shown(entry.get('compiled', {}))}")
    if report.get("defaults_aims"):
        lines += ["", "## furcate's defaults against each peer's fastest precision", ""]
        for aim, entry in report["defaults_aims"].items():
            ratio = entry["ratio"]
            verdict = f"{ratio:.2f}x {'met' if ratio >= entry['target'] else 'missed'}" if ratio else "-"
            lines.append(f"- {aim}: {verdict} (the peer's {entry['peer_precision'] or '-'})")
    lines += ["", "## Batch-1 decode against memory bandwidth", "",
              "Weight bytes a step reads (the embedding table only where it is the tied LM head) x tokens/s, over "
              "the measured read bandwidth.", "",
              "| precision / system | MB per token | tok/s | GB/s | share of bandwidth |", "|---|---|---|---|---|"]
    for key, share in report["decode_bandwidth"].items():
        lines.append(f"| {key} | {share['bytes_per_token'] / 1e6:.1f} | {share['tok_s']:.1f} | {share['gb_s']:.2f} "
                     f"| {share['share']:.0%} |")
    lines += ceiling_lines(report)
    lines += ["", "## Engines", ""]
    for precision, settings in report["vllm_settings"].items():
        lines.append(f"- {precision} vllm given: environment {json.dumps(settings['env'])}, kv_cache_memory_bytes "
                     f"{settings['kv_cache_bytes']} ({MAX_TOKENS} tokens), max_model_len {settings['max_model_len']}, "
                     "enable_prefix_caching True, seed 0; the rest vLLM's defaults")
    for precision, engines in report["engines"].items():
        for system, engine in engines.items():
            lines.append(f"- {precision} {system}: {json.dumps(engine)}")
    lines += ["", "Workloads: " + json.dumps(report["sizes"]), ""]
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path, caption: str = "") -> None:
    """Grouped bars of tok/s per workload and system, one panel per precision; `caption` (the machine, date and
    versions, as the docs' benchmarks page shows them) goes under the panels."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = list(report["engines"])
    figure, axes = plt.subplots(1, len(precisions), figsize=(5 * len(precisions), 4), squeeze=False)
    width = 0.8 / len(SYSTEMS)
    for axis, precision in zip(axes[0], precisions):
        for i, system in enumerate(SYSTEMS):
            values = [report["table"][f"{precision}/{w}"].get(system) for w in WORKLOADS]
            heights = [v if isinstance(v, float) else 0.0 for v in values]
            axis.bar([x + (i - (len(SYSTEMS) - 1) / 2) * width for x in range(len(WORKLOADS))], heights, width,
                     label=system)
        axis.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        axis.set_title(precision)
        axis.set_ylabel("output tok/s")
    axes[0][0].legend()
    figure.suptitle(f"{report['model']}, {report['threads']} threads" + (" (quick)" if report["quick"] else ""))
    if caption:
        figure.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    figure.tight_layout(rect=(0, 0.08 if caption else 0, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
