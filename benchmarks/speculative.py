"""Speculative decoding on the default model: decode speed with and without it, where drafting helps (quoting
or extracting from a long prompt, JSON that copies fields from the prompt, editing code) and where it does not
(free generation), at batch 1 and batch 8. --algorithm NGRAM (prompt lookup) or STANDALONE (a draft model).

Per workload and batch: output tokens per second of each engine (median over rounds, the two engines taking turns
so a change in the machine's load falls on both), the acceptance rate (accepted drafts / drafted tokens), the mean
accepted length (tokens a verify step emits, its accepted drafts plus one), and greedy agreement (requests whose
output is token for token the plain engine's: on CPU the verify forward's batched kernels round differently from
decode's, so a near-tie may flip; on the tiny float32 test models it is exact).

STANDALONE has one real model to pair with itself, so the target is the default model in float32 with dense
weights (dtype float32, quantization none: plain and speculative engines alike) and the drafts are cheaper
versions of it: the same GGUF on its quantized int4/int8 kernels (speculative_draft_model_quantization gguf;
--drafts int4, the default) and its first --draft-layers of 30 layers (a layer-truncated copy, dense; --drafts
truncated).

    python -m benchmarks.speculative [--algorithm NGRAM|STANDALONE] [--drafts int4 truncated] [--max-new-tokens 128]
                                     [--rounds 3] [--threads 2] [--quick]

Writes benchmarks/results/speculative.json and .md (speculative_standalone.* for STANDALONE,
speculative_standalone_truncated.* when the truncated draft is among them; *_quick.* with --quick, a smoke run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import statistics
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BATCHES = (1, 8)

NAMES = ("Alice Moreau", "Bram Kovacs", "Chidi Okafor", "Dana Ishikawa", "Emil Novak", "Farah Haddad",
         "Goran Petrov", "Hana Sato")
CITIES = ("Lisbon", "Tallinn", "Osaka", "Quito", "Nairobi", "Hobart", "Bergen", "Tucson")
TOPICS = ("tidal energy", "bee migration", "glacier melt", "urban gardens", "deep sea vents", "desert rain",
          "coral reefs", "river deltas")


def report_text(i: int) -> str:
    """A long prompt made of records: what extraction and JSON workloads copy from."""
    lines = []
    for j in range(12):
        k = (i + j) % len(NAMES)
        lines.append(f"Record {j + 1}: {NAMES[k]} lives in {CITIES[(k * 3) % 8]} and studies {TOPICS[(k * 5) % 8]}. "
                     f"Their lab reported {17 + 7 * j} samples in {2011 + j} and published the results in the "
                     f"journal of {TOPICS[(k + j) % 8]}.")
    return "\n".join(lines)


# Each workload is (user message, the start of the assistant's answer), rendered with the model's chat template.
Workload = tuple[str, str]


def extraction(i: int) -> Workload:
    return (f"{report_text(i)}\n\nCopy record {3 + i % 6} exactly as written above, word for word.",
            f"Record {3 + i % 6}:")


def json_copy(i: int) -> Workload:
    k = i % len(NAMES)
    return (f"{report_text(i)}\n\nWrite a JSON object with the fields name, city, topic and samples for the "
            f"person in record {1 + k}.", '{"name": "')


CODE = '''def summarize(values, limit):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        if count >= limit:
            break
        total += value
        count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}
'''
RENAMES = (("values", "items"), ("limit", "cap"), ("total", "acc"), ("count", "n"), ("average", "mean"),
           ("value", "item"), ("summarize", "aggregate"), ("limit", "max_items"))


def code_edit(i: int) -> Workload:
    old, new = RENAMES[i % len(RENAMES)]
    return (f"```python\n{CODE}```\n\nRewrite this function with `{old}` renamed to `{new}` everywhere, "
            "otherwise unchanged.", "```python\n")


def free(i: int) -> Workload:
    openings = ("Once upon a time, in a village by the sea,", "The history of the bicycle begins",
                "My favourite recipe for a rainy day is", "In the year 2300, the first city on Mars",
                "The strangest thing about octopuses is", "A short guide to learning the violin:",
                "The old lighthouse keeper told us", "Ten things to do in a new city:")
    return "Write a story of a few paragraphs.", openings[i % len(openings)]


WORKLOADS = {"extraction": extraction, "json": json_copy, "code_edit": code_edit, "free": free}


def truncated_model(model_dir: str | pathlib.Path, out_dir: str | pathlib.Path, num_layers: int) -> pathlib.Path:
    """A copy of an HF model directory with only its first num_layers decoder layers (embedding, final norm and LM
    head kept): a draft model of the same vocabulary that agrees with its source more often than a random one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, out = pathlib.Path(model_dir), pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if layer is None or int(layer.group(1)) < num_layers:
                    kept[name] = handle.get_tensor(name)
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def run_batch(engine, prompts: list[str], max_new_tokens: int) -> tuple[float, list[dict]]:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    started = time.perf_counter()
    out = engine.generate(prompts, params)
    return time.perf_counter() - started, out


def render(tokenizer, workload: Workload) -> str:
    message, answer_start = workload
    chat = [{"role": "user", "content": message}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) + answer_start


def measure(engines: dict, prompts: list[str], args: argparse.Namespace) -> dict:
    """The two engines take turns, one round each, after a warm-up round that leaves each prompt in the prefix
    cache: the timed rounds measure decoding, which is what speculation changes."""
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[dict]] = {}
    for round_index in range(args.rounds + 1):
        for name, engine in engines.items():
            wall, out = run_batch(engine, prompts, args.max_new_tokens)
            if round_index:
                seconds[name].append(wall)
            outputs[name] = out
    return {name: summarize(seconds, outputs, name) for name in engines if name != "plain"}


def summarize(seconds: dict[str, list[float]], outputs: dict[str, list[dict]], name: str) -> dict:
    """One speculative engine's figures against the plain engine's."""
    tokens = sum(len(r["output_ids"]) for r in outputs["plain"])
    spec = outputs[name]
    drafted = sum(r["meta_info"]["spec_draft_token_num"] for r in spec)
    accepted = sum(r["meta_info"]["spec_accept_token_num"] for r in spec)
    verifies = sum(r["meta_info"]["spec_verify_ct"] for r in spec)
    same = [p["output_ids"] == s["output_ids"] for p, s in zip(outputs["plain"], spec)]
    tok_s = {name: tokens / statistics.median(walls) for name, walls in seconds.items()}
    return {
        "output_tokens": tokens,
        "plain_tok_s": tok_s["plain"],
        "speculative_tok_s": tok_s[name],
        "speedup": tok_s[name] / tok_s["plain"],
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / verifies if verifies else 0.0,
        "greedy_agreement": sum(same) / len(same),
    }


def cpu_flags() -> list[str]:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    return sorted({flag for flag in ("avx512_bf16", "amx_tile") if f" {flag}" in text})


def start_engines(args: argparse.Namespace) -> dict:
    """The plain engine and one speculative engine per draft (NGRAM: one), under the same engine arguments."""
    from furcate import Engine

    # A bounded pool: by default each engine (and each draft model) would size its own from a share of free memory.
    common = {"torch_num_threads": args.threads, "grammar_backend": "none", "max_total_tokens": args.max_total_tokens}
    if args.algorithm == "NGRAM":
        spec = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": args.num_draft_tokens,
                "speculative_ngram_min_match_window_size": args.min_window,
                "speculative_ngram_max_match_window_size": args.max_window}
        return {"plain": Engine("default", **common), "speculative": Engine("default", **common, **spec)}
    common.update(dtype="float32", quantization="none")
    engines = {"plain": Engine("default", **common)}
    for name, draft in standalone_drafts(args).items():
        engines[name] = Engine("default", **common, speculative_algorithm="STANDALONE",
                               speculative_num_draft_tokens=args.num_draft_tokens, **draft)
    return engines


def standalone_drafts(args: argparse.Namespace) -> dict[str, dict]:
    """Draft model arguments by row name, of the drafts asked for: the default model on its quantized kernels
    (int4), and truncated to its first layers (truncated; built once into furcate's cache folder)."""
    from furcate.runtime.model.weights.default_model import prepare_default_model

    drafts = {}
    if "int4" in args.drafts:
        drafts["int4 draft"] = {"speculative_draft_model_path": "default",
                                "speculative_draft_model_quantization": "gguf"}
    if "truncated" in args.drafts:
        source = prepare_default_model()
        truncated = source.parent / f"{source.name}-first{args.draft_layers}"
        if not (truncated / "model.safetensors").exists():
            truncated_model(source, truncated, args.draft_layers)
        drafts[f"{args.draft_layers}-layer draft"] = {"speculative_draft_model_path": str(truncated)}
    return drafts


def run(args: argparse.Namespace) -> dict:
    flags, load_before = cpu_flags(), os.getloadavg()
    print(f"CPU flags: {' '.join(flags) or 'none'}; load average before: {load_before}")
    from transformers import AutoTokenizer

    from furcate.runtime.model.weights.default_model import prepare_default_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    engines = start_engines(args)
    try:
        results = {}
        for name in args.workloads:
            for batch in args.batches:
                prompts = [render(tokenizer, WORKLOADS[name](i)) for i in range(batch)]
                for engine_name, result in measure(engines, prompts, args).items():
                    row = f"{name}/batch{batch}" + ("" if engine_name == "speculative" else f" ({engine_name})")
                    results[row] = result
                    print_row(row, result)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_flags": flags, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "settings": settings(args),
        "results": results,
    }


def settings(args: argparse.Namespace) -> dict:
    common = {"algorithm": args.algorithm, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "threads": args.threads, "num_draft_tokens": args.num_draft_tokens,
              "max_total_tokens": args.max_total_tokens}
    if args.algorithm == "NGRAM":
        return {**common, "ngram_window": [args.min_window, args.max_window],
                "model": "default (Engine('default'): dtype and quantization auto)"}
    drafts = {"int4": ("int4 draft", "default, speculative_draft_model_quantization gguf (its Q4_0/Q8_0 kernels)"),
              "truncated": (f"{args.draft_layers}-layer draft",
                            f"default's first {args.draft_layers} of 30 layers, float32 dense")}
    return {**common, "model": "default, dtype float32, quantization none (plain and speculative)",
            "drafts": dict(drafts[name] for name in args.drafts)}


COLUMNS = ("plain tok/s", "spec tok/s", "speedup", "accept rate", "mean accepted len", "greedy agreement")


def row_values(result: dict) -> list[str]:
    return [f"{result['plain_tok_s']:.1f}", f"{result['speculative_tok_s']:.1f}", f"x{result['speedup']:.2f}",
            f"{result['acceptance_rate']:.2f}", f"{result['mean_accepted_length']:.2f}",
            f"{result['greedy_agreement']:.2f}"]


def print_row(name: str, result: dict) -> None:
    print(f"{name:<20} " + "  ".join(f"{label} {value}" for label, value in zip(COLUMNS, row_values(result))))


def markdown(report: dict) -> str:
    settings = report["settings"]
    if settings["algorithm"] == "NGRAM":
        title, how = ("N-gram speculative decoding, default model",
                      f"n-gram window {settings['ngram_window'][0]}..{settings['ngram_window'][1]}")
    else:
        title = "Draft-model (STANDALONE) speculative decoding, default model"
        how = f"target {settings['model']}; drafts: " + "; ".join(f"{k}: {v}" for k, v in settings["drafts"].items())
    lines = [f"# {title}", "",
             f"{report['date']}; CPU flags {', '.join(report['cpu_flags']) or 'none'}; load average before "
             f"{report['load_average_before']}, after {report['load_average_after']}; greedy, "
             f"{settings['max_new_tokens']} new tokens per request, median of {settings['rounds']} rounds, "
             f"{settings['threads']} torch threads, {settings['num_draft_tokens']} draft tokens, {how}.", "",
             "| workload | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(row_values(result)) + " |" for name, result in report["results"].items()]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=["NGRAM", "STANDALONE"], default="NGRAM")
    parser.add_argument("--drafts", nargs="+", choices=["int4", "truncated"], default=["int4"],
                        help="STANDALONE: the draft models measured")
    parser.add_argument("--draft-layers", type=int, default=15, help="STANDALONE: the truncated draft's layers")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="KV slots per engine (and draft model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: every core)")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--min-window", type=int, default=2)
    parser.add_argument("--max-window", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--quick", action="store_true", help="a smoke run: two workloads, batch 1 and 2, 12 tokens")
    args = parser.parse_args()
    if args.quick:
        args.max_new_tokens, args.rounds, args.workloads, args.batches = 12, 1, ["extraction", "free"], [1, 2]
    return args


def result_stem(args: argparse.Namespace) -> str:
    stem = "speculative"
    if args.algorithm == "STANDALONE":
        stem += "_standalone" + ("_truncated" if "truncated" in args.drafts else "")
    return stem + ("_quick" if args.quick else "")


def main() -> None:
    args = parse_args()
    report = run(args)
    stem = result_stem(args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(report))
    print(f"wrote {RESULTS / stem}.json and .md")


if __name__ == "__main__":
    main()
