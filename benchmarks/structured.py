"""Structured generation in one run, on the 375 schemas of the jsonschemabench-dev data set (the team's copy beside
the repository) and the default model.

1. Coverage, per backend (llguidance, xgrammar, outlines-core, and auto, the default route): each schema compiled
   alone, classed exact / approximate / rejected (auto refuses an approximation, as it does a request that does not
   allow one); compile p50/p99; every instance of the data set judged on the grammar as the backend serves it: the
   share of invalid instances wrongly accepted.
2. Compliance: the default model answers the schemas (auto: all; named backends: --compliance-schemas evenly
   spaced), greedy, all in flight at once; of the outputs the grammar finished, the share that validate with
   jsonschema; mask fill p50/p99 as the engine reports it.
3. Cost: decode tokens/s at batch 1 and 16, constrained (a JSON schema that cannot close within the token budget,
   so every request decodes as many tokens as the unconstrained run) against unconstrained, jump-forward on and
   off, under the default engine settings.
4. Peer: the same schemas and prompts through outlines 1.x on HF transformers (same weights and threads, one
   request at a time as its users run it) and through furcate: output tokens/s and validity.

    python -m benchmarks.structured [--compliance-schemas 96] [--sections coverage compliance cost peer]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time

from transformers import AutoTokenizer

from benchmarks.jsonschemabench import BENCH, load_cases
from benchmarks.offline_throughput import CpuMeter
from benchmarks.structured_grammars import (
    measure_compliance,
    measure_coverage,
    schema_prompt,
    validation_error,
)
from furcate import Engine
from furcate.grammars.base import GrammarSpec
from furcate.grammars.registry import make_backend
from furcate.runtime.model.weights.default_model import prepare_default_model

BACKENDS = ("auto", "llguidance", "xgrammar", "outlines")
CITIES = ("Paris", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Rome", "Seoul", "Tunis", "Accra", "Baku", "Cairo",
          "Dakar", "Hanoi", "Kyiv", "Minsk")
# Keys, punctuation and `true`/`false` are forced: the places jump-forward can skip ahead.
USERS = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "name": {"type": "string", "maxLength": 20},
                       "email": {"type": "string", "maxLength": 30},
                       "active": {"type": "boolean"}},
        "required": ["id", "name", "email", "active"],
        "additionalProperties": False,
    },
}


def user_prompts(tokenizer, batch: int) -> list[list[int]]:
    prompts = []
    for city in CITIES[:batch]:
        messages = [{"role": "user", "content": f"List the users of our {city} office as a JSON array of objects "
                                                "with id, name, email and active."}]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=False)))
    return prompts


def decode_rate(engine: Engine, prompts: list[list[int]], constrained: bool, max_new_tokens: int,
                repeats: int) -> tuple[float, int, float]:
    """Best-of-`repeats` output tokens/s (the cache is flushed before each, so every run prefills), the tokens,
    and the CPU seconds other processes took during the best run."""
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    if constrained:
        params["json_schema"] = USERS
    best, tokens, foreign = 0.0, 0, 0.0
    for _ in range(repeats):
        engine.flush_cache()
        meter = CpuMeter()
        started = time.perf_counter()
        results = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - started
        tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
        if tokens / wall > best:
            best, foreign = tokens / wall, meter.foreign_seconds()
    return best, tokens, foreign


def measure_cost(tokenizer, threads: int, max_new_tokens: int, repeats: int) -> list[dict]:
    """Decode tokens/s under the default engine settings, jump-forward on (the default) and off."""
    rows = []
    for jump_forward in (True, False):
        with Engine("default", torch_num_threads=threads, disable_jump_forward=not jump_forward) as engine:
            engine.generate(input_ids=user_prompts(tokenizer, 1), sampling_params={  # warm-up, grammar compile
                "max_new_tokens": 4, "json_schema": USERS})
            for batch in (1, 16):
                prompts = user_prompts(tokenizer, batch)
                for constrained in (False, True):
                    rate, tokens, foreign = decode_rate(engine, prompts, constrained, max_new_tokens, repeats)
                    rows.append({"batch": batch, "constrained": constrained, "jump_forward": jump_forward,
                                 "output_tok_s": rate, "output_tokens": tokens, "foreign_cpu_seconds": foreign})
                    print(f"  batch {batch:>2} constrained {constrained!s:<5} jump-forward {jump_forward!s:<5} "
                          f"{rate:7.1f} tok/s ({tokens} tokens, other processes {foreign:.1f} CPU s)", flush=True)
            rows[-1]["engine_stats"] = {k: v for k, v in engine.get_stats().items()
                                        if k.startswith(("mask_fill", "jumped"))}
    return rows


def rate_of(rows: list[dict], **where) -> float:
    return next(r["output_tok_s"] for r in rows if all(r[k] == v for k, v in where.items()))


def cost_ratios(rows: list[dict]) -> dict:
    ratios = {}
    for batch in (1, 16):
        plain = rate_of(rows, batch=batch, constrained=False, jump_forward=True)
        for jump_forward in (True, False):
            constrained = rate_of(rows, batch=batch, constrained=True, jump_forward=jump_forward)
            ratios[f"b{batch} jump-forward={jump_forward}: constrained/unconstrained"] = constrained / plain
    return ratios


def measure_peer(tokenizer, cases: dict[str, dict], names: list[str], threads: int, max_new_tokens: int) -> dict:
    """furcate (auto) and outlines on the same schemas and prompts: furcate as a batch and one request at a time,
    outlines one at a time (it has no batching of different schemas); tokens/s and validity for each."""
    from benchmarks.outlines_peer import (
        run_outlines,  # outlines is a bench extra
    )

    prompts = [schema_prompt(tokenizer, cases[name]["schema"]) for name in names]
    schemas = [cases[name]["schema"] for name in names]
    params = [{"temperature": 0.0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(schema)}
              for schema in schemas]
    report = {"schemas": names, "max_new_tokens": max_new_tokens}
    with Engine("default", torch_num_threads=threads) as engine:
        engine.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
        for mode in ("furcate_batch", "furcate_sequential"):
            meter, started = CpuMeter(), time.perf_counter()
            if mode == "furcate_batch":
                results = [engine.generate(prompts, params)]
            else:
                results = [engine.generate(prompt, param) for prompt, param in zip(prompts, params)]
            wall = time.perf_counter() - started
            outputs = results[0] if mode == "furcate_batch" else results
            texts = [r["text"] for r in outputs]
            tokens = sum(r["meta_info"]["completion_tokens"] for r in outputs)
            report[mode] = side_summary(schemas, texts, tokens, wall, meter.foreign_seconds())
            engine.flush_cache()
    meter, started = CpuMeter(), time.perf_counter()
    peer = run_outlines(str(prepare_default_model()), prompts, schemas, max_new_tokens, threads)
    wall = time.perf_counter() - started
    report["outlines"] = side_summary(schemas, [r.text for r in peer], sum(r.output_tokens for r in peer), wall,
                                      meter.foreign_seconds())
    report["outlines"].update(generate_seconds=sum(r.generate_seconds for r in peer),
                              compile_seconds=sum(r.compile_seconds for r in peer),
                              errors={name: r.error for name, r in zip(names, peer) if r.error})
    for mode in ("furcate_batch", "furcate_sequential"):
        report[f"{mode}/outlines tok/s"] = report[mode]["output_tok_s"] / report["outlines"]["output_tok_s"]
    return report


def side_summary(schemas: list[dict], texts: list[str | None], tokens: int, wall: float, foreign: float) -> dict:
    problems = [validation_error(schema, text) for schema, text in zip(schemas, texts)]
    return {"valid": sum(problem == "" for problem in problems), "outputs": len(texts), "output_tokens": tokens,
            "wall_seconds": wall, "output_tok_s": tokens / wall, "foreign_cpu_seconds": foreign,
            "invalid": {i: problem for i, problem in enumerate(problems) if problem}}


def evenly_spaced(names: list[str], count: int) -> list[str]:
    if count >= len(names):
        return names
    step = len(names) / count
    return [names[int(i * step)] for i in range(count)]


def auto_backend_for(tokenizer, schema: dict) -> str:
    backend = make_backend("auto", tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], 30.0)
    return backend.compile(GrammarSpec("json_schema", json.dumps(schema))).fidelity.backend


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=("coverage", "compliance", "cost", "peer"),
                        default=("coverage", "compliance", "cost", "peer"))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=BACKENDS)
    parser.add_argument("--schemas", type=int, default=None, help="only this many schemas, evenly spaced (a quick run)")
    parser.add_argument("--compliance-schemas", type=int, default=96,
                        help="schemas each named backend generates for (auto: all of them)")
    parser.add_argument("--compliance-max-new-tokens", type=int, default=256)
    parser.add_argument("--compile-timeout", type=float, default=10.0, help="seconds per schema and backend")
    parser.add_argument("--cost-max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peer-schemas", type=int, default=16)
    parser.add_argument("--peer-max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(pathlib.Path(__file__).parent / "results" / "structured.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not BENCH.is_dir():
        raise SystemExit(f"the jsonschemabench-dev data set is not at {BENCH}")
    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    cases = load_cases()
    cases = {name: cases[name] for name in evenly_spaced(list(cases), args.schemas or len(cases))}
    report: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "settings": vars(args), "coverage": {}, "compliance": {}}
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section, so a late failure keeps what was measured
        output.write_text(json.dumps(report, indent=2) + "\n")
        output.with_suffix(".md").write_text(markdown(report))

    for name in args.backends if "coverage" in args.sections else ():
        report["coverage"][name] = measure_coverage(name, tokenizer, cases, args.compile_timeout)
        print(f"coverage {name}: {json.dumps(report['coverage'][name]['summary'])}", flush=True)
        save()
    for name in args.backends if "compliance" in args.sections else ():
        names = list(cases) if name == "auto" else evenly_spaced(list(cases), args.compliance_schemas)
        compliance = measure_compliance(name, tokenizer, cases, names, args.threads, args.compliance_max_new_tokens,
                                        args.compile_timeout)
        report["compliance"][name] = compliance
        print(f"compliance {name}: {compliance['valid']}/{compliance['checked']} valid of "
              f"{compliance['finished_by_grammar']} finished by the grammar ({compliance['failed']} refused or "
              f"failed); mask fill p50 {compliance['mask_fill_p50_us']:.0f} us p99 "
              f"{compliance['mask_fill_p99_us']:.0f} us", flush=True)
        save()
    if "cost" in args.sections:
        print(f"decode cost on the default model (auto serves the schema with {auto_backend_for(tokenizer, USERS)}):",
              flush=True)
        report["cost"] = measure_cost(tokenizer, args.threads, args.cost_max_new_tokens, args.repeats)
        report["cost_ratios"] = cost_ratios(report["cost"])
        for key, ratio in report["cost_ratios"].items():
            print(f"  {key:<50} {ratio:.3f}")
        save()
    if "peer" in args.sections:
        # Schemas auto enforces exactly and outlines-core compiled in the coverage pass (or all, without it).
        coverage = report["coverage"]
        eligible = [name for name in cases
                    if coverage.get("auto", {}).get("schemas", {}).get(name, {}).get("class", "exact") == "exact"
                    and coverage.get("outlines", {}).get("schemas", {}).get(name, {}).get("class") != "rejected"]
        report["peer"] = measure_peer(tokenizer, cases, evenly_spaced(eligible, args.peer_schemas), args.threads,
                                      args.peer_max_new_tokens)
        print(f"peer: {json.dumps({k: v for k, v in report['peer'].items() if k != 'schemas'}, default=str)[:1500]}")
        save()
    print(f"wrote {output} and {output.with_suffix('.md')}")


def markdown(report: dict) -> str:
    lines = [f"# Structured generation ({report['date']})", "",
             "| backend | exact | approximate | rejected | compile p50 ms | compile p99 ms | invalid accepted "
             "| compliance (finished by grammar) | mask fill p50/p99 us |", "|---|---|---|---|---|---|---|---|---|"]
    for name in BACKENDS:
        cov = report["coverage"].get(name, {}).get("summary")
        comp = report["compliance"].get(name)
        if cov is None and comp is None:
            continue
        cells = ["-"] * 6 if cov is None else [
            f"{cov['exact']} ({cov['exact_share']:.0%})", str(cov["approximate"]), str(cov["rejected"]),
            f"{cov['compile_p50_ms']:.1f}", f"{cov['compile_p99_ms']:.0f}",
            f"{cov['invalid_accepted']}/{cov['invalid_instances']} ({cov['invalid_accepted_share']:.1%})"]
        cells += ["-", "-"] if comp is None else [
            f"{comp['valid']}/{comp['checked']} of {comp['schemas']} schemas",
            f"{comp['mask_fill_p50_us']:.0f}/{comp['mask_fill_p99_us']:.0f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "cost_ratios" in report:
        lines += ["", "| decode cost (default settings) | ratio |", "|---|---|"]
        lines += [f"| {key} | {ratio:.3f} |" for key, ratio in report["cost_ratios"].items()]
    if "peer" in report:
        peer = report["peer"]
        lines += ["", f"Peer: {len(peer['schemas'])} schemas, max_new_tokens {peer['max_new_tokens']}", "",
                  "| side | valid | output tokens | wall s | tok/s |", "|---|---|---|---|---|"]
        for side in ("furcate_batch", "furcate_sequential", "outlines"):
            row = peer[side]
            lines.append(f"| {side} | {row['valid']}/{row['outputs']} | {row['output_tokens']} | "
                         f"{row['wall_seconds']:.1f} | {row['output_tok_s']:.1f} |")
        lines += ["", f"furcate batch / outlines: {peer['furcate_batch/outlines tok/s']:.2f}x; furcate sequential / "
                      f"outlines: {peer['furcate_sequential/outlines tok/s']:.2f}x"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
