"""Every tensor the runtime creates names its device, so the engine runs wherever `device` says (CUDA included).

On a GPU, a tensor created without a device lands on the CPU and breaks the first op that mixes it with the
model's tensors. Here, without a GPU, the scheduler process runs with torch's default device set to "meta" (in
every thread): a tensor created without naming a device is then a meta tensor, which holds no data, so any
such creation on the request path fails the request or makes its output differ from a normal engine's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import EXACT, TINY_POOL_TOKENS, assert_pool_free
from furcate.runtime.engine.engine import Engine

SITECUSTOMIZE = textwrap.dedent("""
    import threading

    import torch

    torch.set_default_device("meta")
    _run = threading.Thread.run


    def _run_on_meta(self):
        torch.set_default_device("meta")  # the default device is per thread: the overlap loop's worker too
        try:
            _run(self)
        finally:
            torch.set_default_device(None)  # a thread that ends with it set aborts the interpreter at exit


    threading.Thread.run = _run_on_meta
""")

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a", "1, 2, 3, 4,"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
REQUESTS = [
    ("greedy", {"max_new_tokens": 8, "temperature": 0}, {}),
    ("sampled", {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.01,
                 "sampling_seed": 7}, {}),
    ("penalties", {"max_new_tokens": 8, "temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                   "presence_penalty": 0.5, "logit_bias": {"11": 5.0}, "min_new_tokens": 4}, {}),
    ("json", {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(SCHEMA)}, {}),
    ("logprobs", {"max_new_tokens": 4, "temperature": 0},
     {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}),
]


def run_requests(engine: Engine) -> list:
    """Each kind of request over the prompts, twice (the second round hits the radix cache)."""
    outputs = []
    for _ in range(2):
        for name, params, extra in REQUESTS:
            for out in engine.generate(PROMPTS, [params] * len(PROMPTS), **extra):
                meta = out["meta_info"]
                entries = [entry for key in sorted(meta) if "logprob" in key for entry in flatten(meta[key])]
                outputs.append((name, out["text"], [e for e in entries if isinstance(e, int)],
                                [e for e in entries if isinstance(e, float)]))
    return outputs


def flatten(value) -> list:
    return [x for item in value for x in flatten(item)] if isinstance(value, list) else [value]


def assert_same_outputs(outputs: list, reference: list) -> None:
    """Same texts and token ids; logprobs equal up to float rounding (the loops batch requests differently)."""
    assert [out[:3] for out in outputs] == [ref[:3] for ref in reference]
    for out, ref in zip(outputs, reference):
        assert out[3] == pytest.approx(ref[3], abs=1e-4)


@pytest.fixture(scope="module")
def reference_outputs(tiny_model_dirs):
    with Engine(str(tiny_model_dirs["llama"]), **EXACT, max_total_tokens=TINY_POOL_TOKENS,
                chunked_prefill_size=8) as engine:
        return run_requests(engine)


def test_engine_creates_no_tensor_on_the_default_device(tiny_model_dirs, reference_outputs, tmp_path, monkeypatch):
    """With the overlap loop: the scheduler thread builds and plans batches, the worker runs forward and
    sampling, so every step's code runs under the meta default (the plain loop runs the same code on one)."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:" + os.environ.get("PYTHONPATH", ""))
    # The harness itself: a fresh interpreter (like the scheduler process) creates tensors on meta, in any thread.
    probe = ("import threading, torch; t = threading.Thread(target=lambda: print(torch.empty(0).device)); "
             "print(torch.empty(0).device); t.start(); t.join()")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.split() == ["meta", "meta"]
    with Engine(str(tiny_model_dirs["llama"]), **EXACT, max_total_tokens=TINY_POOL_TOKENS, chunked_prefill_size=8,
                disable_overlap_schedule=False) as engine:
        outputs = run_requests(engine)
        assert_same_outputs(outputs, reference_outputs)
        assert_pool_free(engine)
