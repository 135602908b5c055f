"""Rewrite the KNOWN_GAPS tables of jsonschemabench_gaps.py from fresh sweeps, after a grammar library is upgraded or a
backend changes what it enforces. Schemas a sweep skips (slow compiles) keep their recorded entries. Review the diff:
every change is a schema some backend now judges differently.

    PYTHONPATH=. python tests/jsonschemabench_regenerate.py      (from the repository root, with the data set beside it)
"""

from __future__ import annotations

import json
import pathlib
import re

from transformers import AutoTokenizer

import jsonschemabench_gaps as recorded
from benchmarks.jsonschemabench import BENCH, load_cases
from furcate.runtime.model.weights.default_model import prepare_default_model
from test_grammar_backends_jsonschemabench import sweep

TABLES = {"llguidance": "LLGUIDANCE", "xgrammar": "XGRAMMAR", "outlines": "OUTLINES", "auto": "AUTO"}
GAPS_FILE = pathlib.Path(__file__).with_name("jsonschemabench_gaps.py")


def gap_reason(verdict) -> str:
    detail = verdict.detail.splitlines()[0][:110] if verdict.detail else "exact grammar"
    detail = re.sub(r"\[[0-9:]{8}\] ", "", detail)  # xgrammar's log timestamps change every run
    return f"{verdict.outcome} -- {detail}"


def main() -> None:
    if not BENCH.is_dir():
        raise SystemExit(f"the jsonschemabench-dev data set is not at {BENCH}")
    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    cases = load_cases()
    source = GAPS_FILE.read_text()
    for backend, table in TABLES.items():
        verdicts = sweep(backend, cases, tokenizer)
        kept = {name: reason for name, reason in recorded.KNOWN_GAPS[backend].items() if name not in verdicts}
        found = {name: gap_reason(verdict) for name, verdict in verdicts.items() if verdict.gap}
        gaps = dict(sorted({**kept, **found}.items()))
        print(f"{backend}: {len(recorded.KNOWN_GAPS[backend])} gaps recorded, {len(gaps)} now", flush=True)
        start = source.index(f"\n{table} = {{") + 1
        end = source.index("\n}\n", start) + 3
        rows = [f"    {json.dumps(name)}: {json.dumps(reason, ensure_ascii=False)}," for name, reason in gaps.items()]
        source = source[:start] + "\n".join([f"{table} = {{", *rows, "}\n"]) + source[end:]
    GAPS_FILE.write_text(source)


if __name__ == "__main__":
    main()
