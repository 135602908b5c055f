"""Where each engine's time goes, by Linux perf: one flat profile per timed workload, its samples grouped into
matmuls, attention, norms and other elementwise work, sampling, the interpreter and framework, thread waits and
the rest, the same rules for every engine (furcate, vLLM's CPU build, llama.cpp, HF).

With FURCATE_BENCH_PERF=DIR set, benchmarks.peers records every timed run (`recording`): `perf record` attached to
the worker and all its descendants (furcate's scheduler process, vLLM's engine core) for exactly the timed call,
into DIR/<system>-<precision>-<workload>.data. oneDNN's JIT kernels get names through its perf map
(DNNL_JIT_PROFILE=1, set for the workers). Then

    python -m benchmarks.perf_profile DIR [--out FILE.md]

prints (and writes) the breakdown per run: each category's share of the samples and its top symbols. Only the
standard library is imported: vLLM's venv runs this module too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

VARIABLE = "FURCATE_BENCH_PERF"
FREQUENCY = 499  # samples a second per CPU: a few thousand per timed run, little overhead
# (category, pattern on "symbol [dso]"), first match wins: the kernels before the machinery that calls them.
CATEGORIES = (
    ("attention", r"attention|attn|paged|sdpa|softmax|flash|cpu_attn|kv_cache|reshape_and_cache|soft_max"),
    ("matmul", r"gemm|gemv|gemm_|brgemm|matmul|mul_mat|sgemm|dgemm|mkl_blas|_dot_|vec_dot|dot_rows|dot_two_rows|"
               r"jit_avx|jit_uni|jit_brg|tinyblas|llamafile|block_gemv|linear|int4pack|int8pack|fbgemm|dnnl|"
               r"mkldnn|quantize_row|ggml_gemv|ggml_gemm|repack|onednn"),
    ("norm & elementwise", r"rms_norm|rmsnorm|layernorm|layer_norm|norm|rope|rotary|silu|swiglu|gelu|"
                           r"cpp_fused|fused_|elementwise|vectorized_loop|vec_add|vec_mul|ggml_compute_forward_add|"
                           r"ggml_compute_forward_mul|ggml_compute_forward_get_rows|embedding|index_select|"
                           r"add_kernel|mul_kernel|copy_kernel|cpu_kernel|vml|sleef|exp|tanh"),
    ("sampling & logits", r"argmax|topk|top_k|sample|sampler|sort|multinomial|logit|penalt|max_kernel|reduce"),
    ("thread waits", r"gomp|kmp|__kmp|omp_|barrier|spin|futex|sched_yield|pthread_cond|do_spin|"
                     r"_raw_spin|nanosleep|poll|epoll"),
    ("memory", r"memcpy|memmove|memset|malloc|free|page_fault|clear_page|alloc|mmap|munmap|copy_user|"
               r"tcmalloc|je_|_int_free|_int_malloc|madvise|zap_"),
    ("python & framework", r"libpython|_PyEval|Py[A-Z_]|_Py|\[python|c10::|at::|torch::|dispatch|"
                           r"TensorImpl|intrusive_ptr|Dispatcher|pybind|inductor|dynamo|guard"),
)


def descendants(pid: int) -> list[int]:
    """pid and every process under it (as offline_throughput.own_pids, for any pid)."""
    pids, index = [pid], 0
    while index < len(pids):
        for path in pathlib.Path(f"/proc/{pids[index]}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the process or thread ended meanwhile
                pids += [int(child) for child in path.read_text().split()]
        index += 1
    return pids


@contextlib.contextmanager
def recording(label: str | None) -> Iterator[None]:
    """perf record on this process and its descendants for the body, into $FURCATE_BENCH_PERF/label.data; nothing
    where the variable is unset or label is None."""
    folder = os.environ.get(VARIABLE)
    if not folder or label is None:
        yield
        return
    target = pathlib.Path(folder) / f"{label}.data"
    target.parent.mkdir(parents=True, exist_ok=True)
    pids = ",".join(str(pid) for pid in descendants(os.getpid()))
    perf = subprocess.Popen(["perf", "record", "-F", str(FREQUENCY), "-p", pids, "-o", str(target), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)  # perf attaches before the timed call starts
    try:
        yield
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)


def samples(data: pathlib.Path) -> dict[str, float]:
    """Share of samples (percent) per "symbol [dso]" in a recording."""
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "sym,dso",
                             "--percent-limit", "0.05"], capture_output=True, text=True, check=True).stdout
    listed = subprocess.run(["perf", "buildid-list", "-i", str(data)], capture_output=True, text=True).stdout
    paths = {pathlib.Path(line.split()[-1]).name: line.split()[-1] for line in listed.splitlines() if line.strip()}
    shares: dict[str, float] = {}
    for line in report.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(.*?)\s{2,}(\S.*?)\s*$", line)  # "[JIT] tid 5" too
        if match:
            key = f"{unnamed_kind(match[2], paths.get(match[3], match[3]))} [{match[3]}]"
            shares[key] = shares.get(key, 0.0) + float(match[1])
    return shares


def unnamed_kind(symbol: str, library: str) -> str:
    """A symbol perf could not name (a stripped library's static code, llama.cpp's tinyBLAS tiles among it) by
    the instructions around it: vector multiply-adds make it an unnamed matmul, anything else stays its address."""
    if not re.fullmatch(r"0x[0-9a-f]+", symbol) or not pathlib.Path(library).is_file():
        return symbol
    address = int(symbol, 16)
    code = subprocess.run(["objdump", "-d", f"--start-address={address - 24}", f"--stop-address={address + 24}",
                           library], capture_output=True, text=True).stdout
    return "unnamed vector multiply-adds (matmul)" if "vfmadd" in code else symbol


def category(symbol: str) -> str:
    lowered = symbol.lower()
    for name, pattern in CATEGORIES:
        if re.search(pattern, lowered if name != "python & framework" else symbol):
            return name
    return "other"


def breakdown(shares: dict[str, float]) -> dict[str, tuple[float, list[tuple[str, float]]]]:
    """Per category: its share and its top symbols."""
    grouped: dict[str, list[tuple[str, float]]] = {}
    for symbol, share in shares.items():
        grouped.setdefault(category(symbol), []).append((symbol, share))
    return {name: (sum(s for _, s in items), sorted(items, key=lambda item: -item[1])[:3])
            for name, items in sorted(grouped.items(), key=lambda kv: -sum(s for _, s in kv[1]))}


def report(folder: pathlib.Path) -> str:
    lines = [f"# Where the time goes (perf, {FREQUENCY} samples/s per CPU)", ""]
    names = [name for name, _ in CATEGORIES] + ["other"]
    runs = sorted(folder.glob("*.data"))
    lines += ["| run | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    details = []
    for data in runs:
        parts = breakdown(samples(data))
        total = sum(share for share, _ in parts.values()) or 1.0
        lines.append(f"| {data.stem} | " + " | ".join(f"{100 * parts.get(n, (0.0, []))[0] / total:.0f}%"
                                                      for n in names) + " |")
        details.append(f"\n## {data.stem}\n")
        details += [f"- {name} {100 * share / total:.1f}%: " + "; ".join(f"{sym[:70]} {s:.1f}%" for sym, s in top)
                    for name, (share, top) in parts.items()]
    return "\n".join(lines + details) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    text = report(args.folder)
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
