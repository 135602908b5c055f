"""Shared-prefix workload with the radix cache on and off, in one run, on the default model.

G groups x P prompts: each group shares a long system prompt, each prompt adds its own short question, and
outputs are short. Prompts are interleaved across groups, so the scheduler (not the arrival order) must find
the sharing. Reports throughput for both, their ratio, the measured cache hit rate, and the hit rate of an
oracle that computes every unique prefix token exactly once.

    python -m benchmarks.shared_prefix [--groups 8] [--prompts-per-group 16] [--system-len 1024]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import time

from transformers import AutoTokenizer

from furcate import Engine
from furcate.runtime.model.weights.default_model import prepare_default_model

WORDS = ("river stone garden signal market ladder window copper silent orange engine winter harbor pencil cloud "
         "forest matter bridge candle number planet velvet thunder basket mirror shadow spring anchor meadow "
         "lantern rocket canyon violin marble desert island feather saddle crystal tunnel").split()


def text_of_length(tokenizer, rng: random.Random, n_tokens: int) -> list[int]:
    """Token ids of random words, cut to exactly n_tokens."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(64)))
    return ids[:n_tokens]


def build_workload(tokenizer, groups: int, per_group: int, system_len: int, question_len: int,
                   seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [text_of_length(tokenizer, rng, system_len) for _ in range(groups)]
    # Interleaved: group 0 prompt 0, group 1 prompt 0, ..., so neighbours in arrival order share nothing.
    return [systems[g] + text_of_length(tokenizer, rng, question_len) for _ in range(per_group) for g in range(groups)]


def unique_prefix_tokens(prompts: list[list[int]]) -> int:
    """The distinct prefix-trie nodes of the prompts: the tokens an ideal prefix cache computes."""
    trie: dict = {}
    unique = 0
    for ids in prompts:
        node = trie
        for token in ids:
            if token not in node:
                node[token] = {}
                unique += 1
            node = node[token]
    return unique


def oracle_hit_rate(prompts: list[list[int]]) -> float:
    """Share of prompt tokens an ideal cache would not compute: all but the distinct prefix-trie nodes."""
    total = sum(len(p) for p in prompts)
    return (total - unique_prefix_tokens(prompts)) / total


def run(prompts: list[list[int]], output_len: int, threads: int, radix: bool) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    total_tokens = sum(len(p) for p in prompts) + output_len * len(prompts)
    pool = int(total_tokens * 1.1)
    with Engine("default", torch_num_threads=threads, max_total_tokens=pool, disable_radix_cache=not radix) as engine:
        engine.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 2})  # warm-up
        engine.flush_cache()
        before = engine.get_stats()
        started = time.perf_counter()
        results = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - started
        after = engine.get_stats()
    prompt_tokens = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    return {
        "radix_cache": radix,
        "wall_seconds": wall,
        "requests_per_s": len(prompts) / wall,
        "output_tok_s": output_len * len(prompts) / wall,
        "input_tok_s": prompt_tokens / wall,
        "cache_hit_rate": cached / prompt_tokens,
        "forward_share": (after["forward_seconds"] - before["forward_seconds"]) / wall,
        "outputs": [r["output_ids"] for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=str(pathlib.Path(__file__).parent / "results" / "shared_prefix.json"))
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    prompts = build_workload(tokenizer, args.groups, args.prompts_per_group, args.system_len, args.question_len,
                             args.seed)
    oracle = oracle_hit_rate(prompts)
    on = run(prompts, args.output_len, args.threads, radix=True)
    off = run(prompts, args.output_len, args.threads, radix=False)
    same_outputs = on.pop("outputs") == off.pop("outputs")

    print(f"{args.groups} groups x {args.prompts_per_group} prompts, system {args.system_len} + question "
          f"{args.question_len} tokens, {args.output_len} output tokens, torch threads {args.threads}")
    print(f"{'radix cache':<12}{'wall s':>9}{'req/s':>9}{'out tok/s':>11}{'hit rate':>10}{'forward':>9}")
    for row in (on, off):
        print(f"{'on' if row['radix_cache'] else 'off':<12}{row['wall_seconds']:>9.2f}{row['requests_per_s']:>9.2f}"
              f"{row['output_tok_s']:>11.1f}{row['cache_hit_rate']:>10.1%}{row['forward_share']:>9.1%}")
    speedup = off["wall_seconds"] / on["wall_seconds"]
    print(f"throughput with / without the radix cache: {speedup:.2f}x")
    print(f"hit rate {on['cache_hit_rate']:.1%} vs oracle {oracle:.1%} "
          f"({on['cache_hit_rate'] / oracle:.1%} of the oracle's)")
    print(f"greedy outputs identical with and without the cache: {same_outputs}")

    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "workload": vars(args),
              "radix_on": on, "radix_off": off, "speedup": speedup, "oracle_hit_rate": oracle,
              "hit_rate_vs_oracle": on["cache_hit_rate"] / oracle, "identical_outputs": same_outputs}
    pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
