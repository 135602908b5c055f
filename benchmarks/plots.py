"""Draws the saved benchmark results (benchmarks/results/*.json) as PNGs for the docs' benchmarks page.

`python -m benchmarks.plots --out DIR` writes one plot per result file that is there, each with the machine, the
date and the versions its JSON records (or, for peers the JSON does not name, the version pyproject.toml pins for
them) under it. The docs build runs it (docs/hooks/plots.py), so the plots always show the committed results.
The peers plots are benchmarks/peers_report.py's own, given that caption.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tomllib
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")  # headless: the docs build and CI have no display

import matplotlib.pyplot as plt

from benchmarks import peers_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PEER_FILES = ("peers", "peers_1b", "peers_1b_quantized", "peers_vllm", "peers_no_bf16", "peers_1b_quantized_no_bf16",
              "peers_epyc", "peers_1b_quantized_epyc", "peers_avx2_emulation")


def pinned(package: str) -> str:
    """The version pyproject.toml pins for `package` (dependencies or an extra), or '?'."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                                for r in extra)]
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        if name.strip().lower() == package.lower() and version:
            return version
    return "?"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def machine(flags: list[str] | None, threads: int | None) -> str:
    shown = ", ".join(flags) if flags else "no avx512_bf16/amx_tile"
    return f"{threads if threads else 'default'} threads, CPU flags: {shown}"


def finish(figure: plt.Figure, caption: str, path: pathlib.Path) -> None:
    figure.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def bars(axis: plt.Axes, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        axis.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
    axis.set_xticks(range(len(labels)), labels)
    axis.set_ylabel(ylabel)
    axis.legend(fontsize=8)


def plot_peers(name: str, out: pathlib.Path) -> pathlib.Path | None:
    report = load(name)
    if report is None:
        return None
    versions = report["versions"]
    held = "; every system held to AVX2 (emulation)" if report.get("held_to_avx2") else ""
    caption = (f"{report['date'][:10]}; {machine(report['cpu_flags'], report['threads'])}{held}; furcate "
               f"{versions['furcate']}, llama-cpp-python {versions['llama_cpp']}, vLLM {versions.get('vllm') or '-'}, "
               f"transformers {versions['transformers']}, torch {versions['torch']}; memory read "
               f"{report['bandwidth']['read_gb_s']:.1f} GB/s")
    path = out / f"{name}.png"
    peers_report.plot(report, path, caption)
    return path


def plot_programs(out: pathlib.Path) -> pathlib.Path | None:
    report = load("programs")
    if report is None:
        return None
    kinds = list(report["kinds"])
    sides = {"furcate run_batch": "F", "sequential Engine.generate": "a", "guidance on HF": "b"}
    series = {label: [report["kinds"][k][side]["programs_per_s"] for k in kinds] for label, side in sides.items()}
    figure, axis = plt.subplots(figsize=(7, 4))
    bars(axis, kinds, series, "programs/s")
    axis.set_title("Programs on the default model")
    caption = (f"{report['date'][:10]}; {report['config']['threads']} threads each; guidance {pinned('guidance')}; "
               f"load before {report['loadavg_before']}")
    path = out / "programs.png"
    finish(figure, caption, path)
    return path


def plot_structured(out: pathlib.Path) -> pathlib.Path | None:
    report = load("structured")
    if report is None:
        return None
    backends = list(report["coverage"])
    summaries = [report["coverage"][b]["summary"] for b in backends]
    series = {"schemas enforced exactly": [s["exact_share"] * 100 for s in summaries],
              "invalid instances accepted": [s["invalid_accepted_share"] * 100 for s in summaries]}
    figure, axis = plt.subplots(figsize=(7, 4))
    bars(axis, backends, series, "% of JSONSchemaBench schemas / instances")
    axis.set_title(f"Grammar backends on {summaries[0]['schemas']} schemas")
    caption = (f"{report['date'][:10]}; {report['settings']['threads']} threads; llguidance {pinned('llguidance')}, "
               f"xgrammar {pinned('xgrammar')}, outlines-core {pinned('outlines-core')}")
    path = out / "structured.png"
    finish(figure, caption, path)
    return path


def plot_speculative(out: pathlib.Path) -> pathlib.Path | None:
    ngram, standalone = load("speculative"), load("speculative_standalone")
    if ngram is None:
        return None
    workloads = list(ngram["results"])
    series = {"NGRAM": [ngram["results"][w]["speedup"] for w in workloads]}
    if standalone is not None:
        by_workload = {key.split(" ")[0]: row for key, row in standalone["results"].items()}
        series["STANDALONE (int4 draft)"] = [by_workload.get(w, {}).get("speedup", 0.0) for w in workloads]
    figure, axis = plt.subplots(figsize=(9, 4))
    bars(axis, [w.replace("/", "\n") for w in workloads], series, "speed-up over plain decoding")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_title("Speculative decoding on the default model")
    load_before = " ".join(f"{x:.1f}" for x in ngram["load_average_before"])
    caption = (f"{ngram['date'][:10]}; {machine(ngram['cpu_flags'], ngram['settings']['threads'])}; load {load_before} "
               "before (the machine was busy with other work)")
    path = out / "speculative.png"
    finish(figure, caption, path)
    return path


def plot_radix(out: pathlib.Path) -> pathlib.Path | None:
    offline, shared = load("offline_throughput"), load("shared_prefix")
    if offline is None or shared is None:
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(8, 4))
    left.bar(["furcate", "HF generate"], [offline["furcate"]["output_tok_s"], offline["hf"]["output_tok_s"]])
    left.set_ylabel("output tok/s")
    left.set_title("Offline batch")
    right.bar(["radix cache on", "off"], [shared["radix_on"]["output_tok_s"], shared["radix_off"]["output_tok_s"]])
    right.set_title("Shared system prompts")
    caption = (f"{offline['date'][:10]} and {shared['date'][:10]}; {offline['torch_threads']} threads; torch "
               f"{offline['torch_version']}; transformers (HF generate) as installed then")
    path = out / "radix.png"
    finish(figure, caption, path)
    return path


PLOTS: tuple[Callable[[pathlib.Path], pathlib.Path | None], ...] = (
    *(lambda out, name=name: plot_peers(name, out) for name in PEER_FILES),
    plot_programs, plot_structured, plot_speculative, plot_radix,
)


def draw_all(out: pathlib.Path) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [path for draw in PLOTS if (path := draw(out)) is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="folder the PNGs are written to")
    for path in draw_all(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
