"""Structured generation in one run: grammar coverage, compliance and cost, on ../shared/data/jsonschemabench-dev
and the default model.

1. Coverage: each backend compiles every schema of the data set (outlines-core under its time and memory limits);
   compile time p50/p99 over the schemas that compiled.
2. Compliance: the default model answers a sample of the compiled schemas, greedy, through the engine; of the
   outputs the grammar finished, the share that validate with jsonschema. The engine reports per-token mask fill
   time p50/p99.
3. Cost: decode tokens/s at batch 1 and 16, constrained (a JSON schema that cannot close within the token budget,
   so every request decodes exactly as many tokens as the unconstrained run) against unconstrained, with the
   overlap loop on and off and jump-forward on and off.

    python benchmarks/structured.py [--compliance-schemas 96] [--skip-outlines]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import io
import json
import os
import pathlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator

import jsonschema
import referencing.exceptions
from transformers import AutoTokenizer

from furcate import Engine
from furcate.benchmarks.offline_throughput import CpuMeter
from furcate.grammars.base import GrammarSpec
from furcate.grammars.cache import make_backend
from furcate.runtime.model.default_model import prepare_default_model
from furcate.runtime.scheduler.grammar_queue import percentile

BENCH = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev"
BACKENDS = ("xgrammar", "outlines")
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


@dataclass
class Coverage:
    compiled: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    compile_ms: list[float] = field(default_factory=list)
    # Schemas the backend compiled but said it cannot represent exactly (xgrammar logs a warning and, for
    # instance, treats oneOf as anyOf or drops allOf branches), with its first warning.
    approximated: dict[str, str] = field(default_factory=dict)

    def summary(self, total: int) -> dict:
        return {"compiled": len(self.compiled), "total": total, "coverage": len(self.compiled) / total,
                "approximated": len(self.approximated),
                "compile_p50_ms": percentile(self.compile_ms, 50), "compile_p99_ms": percentile(self.compile_ms, 99),
                "compile_max_ms": max(self.compile_ms, default=0.0),
                "failures_by_kind": failure_kinds(self.failed)}


def failure_kinds(failed: dict[str, str]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for reason in failed.values():
        kind = "time limit" if "within" in reason else "memory limit" if "memory" in reason else "unsupported"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def load_cases() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(BENCH.glob("*.json"))}


def measure_coverage(backend_name: str, tokenizer, cases: dict[str, dict], timeout_s: float) -> Coverage:
    backend = make_backend(backend_name, tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], timeout_s)
    coverage = Coverage()
    for name, case in cases.items():
        with native_stderr_captured() as captured:
            started = time.perf_counter()
            try:
                backend.compile(GrammarSpec("json_schema", json.dumps(case["schema"])))
            except ValueError as error:
                coverage.failed[name] = str(error)[:300]
                continue
            finally:
                elapsed_ms = (time.perf_counter() - started) * 1e3
        coverage.compile_ms.append(elapsed_ms)
        coverage.compiled.append(name)
        warnings = [line for line in captured.read().splitlines() if "Warning" in line]
        if warnings:
            coverage.approximated[name] = warnings[0].split("Warning: ", 1)[-1]
    return coverage


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[io.StringIO]:
    """What native code writes to file descriptor 2 inside the block (xgrammar's C++ warnings), readable after."""
    text = io.StringIO()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.write(sink.read().decode(errors="replace"))
            text.seek(0)


def schema_prompt(tokenizer, schema: dict) -> list[int]:
    text = json.dumps(schema)
    text = text if len(text) <= 2000 else text[:2000] + " ..."
    messages = [{"role": "system", "content": "You answer with one JSON value and nothing else."},
                {"role": "user", "content": f"Give an example JSON instance of this JSON schema:\n{text}"}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def validation_error(schema: dict, text: str) -> str | None:
    """Why the output is not an instance of the schema ("" when it is one); None when the schema itself cannot
    be checked."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not JSON: {error}"
    try:
        error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema)
                                                 .iter_errors(instance))
    except (jsonschema.exceptions.SchemaError, referencing.exceptions.Unresolvable):
        return None
    return "" if error is None else f"{error.message[:160]} (at {error.json_path}, {error.validator})"


async def generate_each(engine: Engine, prompts: list[list[int]], params: list[dict]) -> list[dict | Exception]:
    """One result or error per request: a schema that fails to compile fails its own request only."""
    return await asyncio.gather(*(engine.async_generate(input_ids=prompt, sampling_params=param)
                                  for prompt, param in zip(prompts, params)), return_exceptions=True)


def measure_compliance(backend_name: str, tokenizer, cases: dict[str, dict], names: list[str], threads: int,
                       max_new_tokens: int, timeout_s: float, approximated: dict[str, str]) -> dict:
    prompts = [schema_prompt(tokenizer, cases[name]["schema"]) for name in names]
    params = [{"temperature": 0.0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(cases[name]["schema"])}
              for name in names]
    # Compiles compete with decoding for the cores here, so they get more time than in the coverage pass.
    with Engine("default", torch_num_threads=threads, grammar_backend=backend_name,
                grammar_compile_timeout=3 * timeout_s) as engine:
        started = time.perf_counter()
        results = asyncio.run(generate_each(engine, prompts, params))
        wall = time.perf_counter() - started
        stats = engine.get_stats()
    failed = {name: str(r) for name, r in zip(names, results) if isinstance(r, Exception)}
    verdicts, invalid = {}, {}  # of the outputs the grammar finished: "valid", "invalid" or "unchecked"
    for name, result in zip(names, results):
        if isinstance(result, Exception) or result["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        problem = validation_error(cases[name]["schema"], result["text"])
        verdicts[name] = "unchecked" if problem is None else "invalid" if problem else "valid"
        if problem:
            invalid[name] = {"why": problem, "output": result["text"][:300]}
    checked = [name for name, verdict in verdicts.items() if verdict != "unchecked"]
    exact = [name for name in checked if name not in approximated]
    return {"schemas": len(names), "failed": failed, "finished_by_grammar": len(verdicts),
            "unchecked": len(verdicts) - len(checked), "valid": len(checked) - len(invalid),
            "compliance": share_valid(verdicts, checked), "invalid": invalid,
            "exact_schemas_checked": len(exact), "compliance_on_exact_schemas": share_valid(verdicts, exact),
            "wall_seconds": wall,
            "output_tokens": sum(r["meta_info"]["completion_tokens"] for r in results if isinstance(r, dict)),
            "mask_fill_p50_us": stats["mask_fill_p50_us"], "mask_fill_p99_us": stats["mask_fill_p99_us"],
            "mask_fills": stats["mask_fills"]}


def share_valid(verdicts: dict[str, str], names: list[str]) -> float | None:
    return sum(verdicts[name] == "valid" for name in names) / len(names) if names else None


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
    rows = []
    for overlap in (False, True):
        for jump_forward in (False, True):
            with Engine("default", torch_num_threads=threads, disable_overlap_schedule=not overlap,
                        disable_jump_forward=not jump_forward) as engine:
                engine.generate(input_ids=user_prompts(tokenizer, 1), sampling_params={  # warm-up, grammar compile
                    "max_new_tokens": 4, "json_schema": USERS})
                for batch in (1, 16):
                    prompts = user_prompts(tokenizer, batch)
                    for constrained in (False, True) if not jump_forward else (True,):
                        rate, tokens, foreign = decode_rate(engine, prompts, constrained, max_new_tokens, repeats)
                        rows.append({"batch": batch, "constrained": constrained, "overlap": overlap,
                                     "jump_forward": jump_forward, "output_tok_s": rate, "output_tokens": tokens,
                                     "foreign_cpu_seconds": foreign})
                        print(f"  batch {batch:>2} constrained {constrained!s:<5} overlap {overlap!s:<5} "
                              f"jump-forward {jump_forward!s:<5} {rate:7.1f} tok/s ({tokens} tokens, other "
                              f"processes {foreign:.1f} CPU s)", flush=True)
                rows[-1]["engine_stats"] = {k: v for k, v in engine.get_stats().items()
                                            if k.startswith(("mask_fill", "jumped"))}
    return rows


def rate_of(rows: list[dict], **where) -> float:
    return next(r["output_tok_s"] for r in rows if all(r[k] == v for k, v in where.items()))


def cost_ratios(rows: list[dict]) -> dict:
    ratios = {}
    for batch in (1, 16):
        for overlap in (False, True):
            plain = rate_of(rows, batch=batch, constrained=False, overlap=overlap, jump_forward=False)
            for jump_forward in (False, True):
                constrained = rate_of(rows, batch=batch, constrained=True, overlap=overlap, jump_forward=jump_forward)
                ratios[f"b{batch} overlap={overlap} jf={jump_forward}: constrained/unconstrained"] = constrained / plain
        for constrained, jump_forward in ((False, False), (True, False), (True, True)):
            on = rate_of(rows, batch=batch, constrained=constrained, overlap=True, jump_forward=jump_forward)
            off = rate_of(rows, batch=batch, constrained=constrained, overlap=False, jump_forward=jump_forward)
            ratios[f"b{batch} constrained={constrained} jf={jump_forward}: overlap on/off"] = on / off
        for overlap in (False, True):
            on = rate_of(rows, batch=batch, constrained=True, overlap=overlap, jump_forward=True)
            off = rate_of(rows, batch=batch, constrained=True, overlap=overlap, jump_forward=False)
            ratios[f"b{batch} overlap={overlap}: jump-forward on/off"] = on / off
    return ratios


def evenly_spaced(names: list[str], count: int) -> list[str]:
    if count >= len(names):
        return names
    step = len(names) / count
    return [names[int(i * step)] for i in range(count)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compliance-schemas", type=int, default=96, help="schemas each backend generates for")
    parser.add_argument("--compliance-max-new-tokens", type=int, default=256)
    parser.add_argument("--compile-timeout", type=float, default=10.0, help="seconds per schema and backend")
    parser.add_argument("--cost-max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-outlines", action="store_true")
    parser.add_argument("--sections", nargs="+", choices=("grammars", "cost"), default=("grammars", "cost"),
                        help="grammars: coverage and compliance per backend; cost: decode tokens/s")
    parser.add_argument("--output", default=str(pathlib.Path(__file__).parent / "results" / "structured.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    cases = load_cases()
    backends = BACKENDS[:1] if args.skip_outlines else BACKENDS
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "settings": vars(args), "coverage": {}, "compliance": {}}

    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section, so a late failure keeps what was measured
        output.write_text(json.dumps(report, indent=2) + "\n")

    for name in backends if "grammars" in args.sections else ():
        coverage = measure_coverage(name, tokenizer, cases, args.compile_timeout)
        report["coverage"][name] = coverage.summary(len(cases)) | {"failed": coverage.failed,
                                                                   "approximated_schemas": coverage.approximated}
        summary = report["coverage"][name]
        print(f"{name}: compiled {summary['compiled']}/{len(cases)}, compile p50 {summary['compile_p50_ms']:.1f} ms"
              f" p99 {summary['compile_p99_ms']:.1f} ms, failures {summary['failures_by_kind']}", flush=True)
        sample = evenly_spaced(coverage.compiled, args.compliance_schemas)
        compliance = measure_compliance(name, tokenizer, cases, sample, args.threads, args.compliance_max_new_tokens,
                                        args.compile_timeout, coverage.approximated)
        report["compliance"][name] = compliance
        print(f"{name}: {compliance['finished_by_grammar']}/{compliance['schemas']} finished by the grammar "
              f"({len(compliance['failed'])} failed), "
              f"{compliance['valid']} valid, {compliance['unchecked']} unchecked -> compliance "
              f"{compliance['compliance']} ({compliance['compliance_on_exact_schemas']} on schemas compiled without "
              f"approximation); mask fill p50 {compliance['mask_fill_p50_us']:.0f} us p99 "
              f"{compliance['mask_fill_p99_us']:.0f} us", flush=True)
        save()

    if "cost" not in args.sections:
        return
    print("decode cost on the default model (xgrammar):", flush=True)
    rows = measure_cost(tokenizer, args.threads, args.cost_max_new_tokens, args.repeats)
    report["cost"] = rows
    report["cost_ratios"] = cost_ratios(rows)
    for key, ratio in report["cost_ratios"].items():
        print(f"  {key:<55} {ratio:.3f}")

    save()
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
