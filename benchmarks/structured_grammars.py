"""Per grammar backend on the jsonschemabench-dev schemas: coverage and matcher fidelity (no model), then the
compliance of the default model's outputs through the engine. Used by benchmarks/structured.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import jsonschema
import referencing
import referencing.exceptions
from tqdm import tqdm

from benchmarks.jsonschemabench import cached_encoder, judge
from furcate import Engine
from furcate.grammars.base import GrammarSpec
from furcate.grammars.registry import make_backend
from furcate.runtime.scheduler.plugins.grammar_queue import percentile

# How a schema fares with a backend: its grammar enforces the schema exactly, approximates it (served by a named
# backend; auto refuses it unless the request allows approximation), or there is no grammar.
CLASSES = ("exact", "approximate", "rejected")


def measure_coverage(backend_name: str, tokenizer, cases: dict[str, dict], timeout_s: float) -> dict:
    """Each schema compiled alone (so compile times are not shared with another compile), classed, and every
    instance of the data set judged on its grammar as the backend serves it."""
    stop = tokenizer.eos_token_id
    backend = make_backend(backend_name, tokenizer, tokenizer.vocab_size, [stop], timeout_s)
    encode = cached_encoder(tokenizer)
    rows: dict[str, dict] = {}
    # Some schemas compile for seconds and the whole set takes minutes: the bar (stderr) shows where it is.
    for name, case in tqdm(cases.items(), desc=f"coverage {backend_name}", unit="schema"):
        started = time.perf_counter()
        try:
            compiled = backend.compile(GrammarSpec("json_schema", json.dumps(case["schema"])))
        except ValueError as error:
            rows[name] = {"class": "rejected", "why": str(error)[:300]}
            continue
        compile_ms = (time.perf_counter() - started) * 1e3
        fidelity = compiled.fidelity
        if backend_name == "auto" and not fidelity.exact:  # as a request without allow_approximate_schema
            rows[name] = {"class": "rejected", "why": f"refused: {fidelity.describe()}"[:300], "compile_ms": compile_ms}
            continue
        verdict = judge(compiled, encode, case["tests"], stop)
        rows[name] = {"class": "exact" if fidelity.exact else "approximate", "backend": fidelity.backend,
                      "compile_ms": compile_ms, "valid_accepted": verdict.valid_accepted,
                      "valid": sum(test["valid"] for test in case["tests"]),
                      "invalid_accepted": len(verdict.wrongly_accepted),
                      "invalid": sum(not test["valid"] for test in case["tests"])}
    return {"summary": coverage_summary(rows, cases), "schemas": rows}


def coverage_summary(rows: dict[str, dict], cases: dict[str, dict]) -> dict:
    """Counts per class, compile percentiles over the grammars built, and the instance shares over the whole data
    set (a rejected schema accepts none of its instances)."""
    compile_ms = [row["compile_ms"] for row in rows.values() if "compile_ms" in row]
    served = [row for row in rows.values() if row["class"] != "rejected"]
    invalid = sum(not test["valid"] for case in cases.values() for test in case["tests"])
    valid = sum(test["valid"] for case in cases.values() for test in case["tests"])
    wrongly = sum(row["invalid_accepted"] for row in served)
    return {"schemas": len(rows), **{cls: sum(row["class"] == cls for row in rows.values()) for cls in CLASSES},
            "exact_share": sum(row["class"] == "exact" for row in rows.values()) / len(rows),
            "compile_p50_ms": percentile(compile_ms, 50), "compile_p99_ms": percentile(compile_ms, 99),
            "invalid_instances": invalid, "invalid_accepted": wrongly, "invalid_accepted_share": wrongly / invalid,
            "schemas_accepting_invalid": sum(row["invalid_accepted"] > 0 for row in served),
            "valid_instances": valid, "valid_accepted": sum(row["valid_accepted"] for row in served),
            "valid_rejected_on_served_schemas": sum(row["valid"] - row["valid_accepted"] for row in served)}


def schema_prompt(tokenizer, schema: dict) -> str:
    text = json.dumps(schema)
    text = text if len(text) <= 2000 else text[:2000] + " ..."
    messages = [{"role": "system", "content": "You answer with one JSON value and nothing else."},
                {"role": "user", "content": f"Give an example JSON instance of this JSON schema:\n{text}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def validation_error(schema: dict, text: str | None) -> str | None:
    """Why `text` is not an instance of the schema ("" when it is one); None when the schema itself cannot be
    checked. Independent of the engine's own check (runtime/engine/schema_check.py), which this cross-checks."""
    if text is None:
        return "no output"
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not JSON: {error}"
    try:
        cls = jsonschema.validators.validator_for(schema)
        validator = cls(schema, registry=referencing.Registry(), format_checker=cls.FORMAT_CHECKER)
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    except (jsonschema.exceptions.SchemaError, referencing.exceptions.Unresolvable):
        return None
    return "" if error is None else f"{error.message[:160]} (at {error.json_path}, {error.validator})"


async def generate_each(engine: Engine, prompts: list[str], params: list[dict]) -> list[Any]:
    """One result or error per request: a schema refused or failing to compile fails its own request only."""
    return await asyncio.gather(*(engine.async_generate(prompt, param) for prompt, param in zip(prompts, params)),
                                return_exceptions=True)


def measure_compliance(backend_name: str, tokenizer, cases: dict[str, dict], names: list[str], threads: int,
                       max_new_tokens: int, timeout_s: float) -> dict:
    """The default model answers each schema, greedy, all requests in flight at once; of the outputs the grammar
    finished, the share that validate."""
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
    finished, invalid, engine_disagrees = {}, {}, []
    for name, result in zip(names, results):
        if isinstance(result, Exception) or result["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        problem = validation_error(cases[name]["schema"], result["text"])
        finished[name] = "unchecked" if problem is None else "invalid" if problem else "valid"
        if problem:
            invalid[name] = {"why": problem, "output": result["text"][:300]}
        if problem is not None and result["meta_info"].get("schema_valid") != (problem == ""):
            engine_disagrees.append(name)
    checked = [name for name, verdict in finished.items() if verdict != "unchecked"]
    valid = sum(finished[name] == "valid" for name in checked)
    return {"schemas": len(names), "failed": sum(isinstance(r, Exception) for r in results),
            "failures": {name: str(r)[:200] for name, r in zip(names, results) if isinstance(r, Exception)},
            "finished_by_grammar": len(finished), "checked": len(checked), "valid": valid,
            "compliance": valid / len(checked) if checked else None, "invalid": invalid,
            "engine_verdict_disagrees": engine_disagrees,
            "engine_schema_violations": stats["schema_violations"], "wall_seconds": wall,
            "output_tokens": sum(r["meta_info"]["completion_tokens"] for r in results if isinstance(r, dict)),
            "mask_fill_p50_us": stats["mask_fill_p50_us"], "mask_fill_p99_us": stats["mask_fill_p99_us"],
            "mask_fills": stats["mask_fills"]}
