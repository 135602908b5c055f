"""The triton attention backend's kernels, run on CPU under the Triton interpreter and checked against
torch_native: decode (split-KV), extend with and without a cached prefix, mixed batches, GQA and MHA, sliding
windows, float32/float16/bfloat16, head_dim 16, 64 and 80, and tiny random llama and mistral models end to end;
and compiled for sm_80 and sm_90 without a GPU.

Both run in child processes, started together so they share the cores: the checks (triton_interpreter_checks.py)
with TRITON_INTERPRET=1, which takes effect only if set before triton is first imported (other tests in this
process may have imported it), the compilation (triton_compile_check.py) without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from triton_interpreter_checks import CHECKS

TRITON = importlib.util.find_spec("triton")
pytestmark = pytest.mark.skipif(TRITON is None, reason="triton is not installed: the triton attention backend "
                                                       "cannot run")

TESTS = Path(__file__).resolve().parent


def start(module: str, **env: str) -> subprocess.Popen:
    """The helper module run as a script (its folder first on sys.path, so it imports its sibling helpers); it
    imports furcate as this process does, through the same installed package or PYTHONPATH."""
    environ = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"} | env
    return subprocess.Popen([sys.executable, str(TESTS / f"{module}.py")], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(child: subprocess.Popen) -> str:
    """The child's stdout, once it exited cleanly. A negative exit code is a signal: -11 is a kernel reading
    outside a tensor under the interpreter; the checks child names on stderr the check it was running."""
    try:
        out, err = child.communicate(timeout=600)
    finally:
        child.kill()
    assert child.returncode == 0, f"{child.args[-1]} exited with {child.returncode}:\n{err[-4000:]}"
    return out


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict[str, subprocess.Popen]:
    cache = tmp_path_factory.mktemp("triton_cache")  # a fresh cache: the compile check really compiles
    started = {"checks": start("triton_interpreter_checks", TRITON_INTERPRET="1"),
               "compile": start("triton_compile_check", TRITON_CACHE_DIR=str(cache))}
    yield started
    for child in started.values():
        if child.poll() is None:  # a child whose test did not run (deselected, failed early)
            child.kill()
            child.communicate()


@pytest.fixture(scope="module")
def interpreter_results(children) -> dict[str, str | None]:
    return json.loads(finish(children["checks"]).strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_kernels_match_torch_native_under_the_interpreter(interpreter_results, name):
    assert name in interpreter_results, f"the child process did not run {name}"
    failure = interpreter_results[name]
    assert failure is None, failure


@pytest.mark.skipif(TRITON is None or not any(Path(p, "backends/nvidia/bin/ptxas").exists()
                                              for p in TRITON.submodule_search_locations),
                    reason="this triton has no bundled ptxas to compile for NVIDIA GPUs with")
def test_kernels_compile_for_sm80_and_sm90_without_a_gpu(children):
    assert finish(children["compile"]).strip().endswith("compiled")
