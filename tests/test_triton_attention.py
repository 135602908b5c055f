"""The triton attention backend's kernels, run on CPU under the Triton interpreter and checked against
torch_native: decode (split-KV), extend with and without a cached prefix, mixed batches, GQA and MHA, sliding
windows, float32/float16/bfloat16, head_dim 64 and 80, and tiny random llama and mistral models end to end.

The checks live in triton_interpreter_checks.py and run once, in one child process with TRITON_INTERPRET=1
(the interpreter is picked when triton is first imported, which other tests here may already have done).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .triton_interpreter_checks import CHECKS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: the triton attention backend cannot run")

# The directory that holds the furcate package, so the child imports this checkout, not an installed copy.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "furcate.tests.triton_interpreter_checks"], env=env,
                          cwd=PACKAGE_PARENT, capture_output=True, text=True, timeout=600)
    # A negative code is a signal: -11 is a kernel reading outside a tensor; stderr names the check it ran.
    assert done.returncode == 0, f"interpreter child exited with {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_kernels_match_torch_native_under_the_interpreter(interpreter_results, name):
    assert name in interpreter_results, f"the child process did not run {name}"
    failure = interpreter_results[name]
    assert failure is None, failure

