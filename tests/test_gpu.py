"""The GPU path end to end: greedy output equal to HF transformers' with every attention backend this build has,
CUDA graphs on and off, the overlap loop, chunked prefill and the radix cache; grammars and sampling on the GPU.

These need CUDA and skip without it (benchmarks/gpu_check.sh runs them on a GPU machine). Without the default
model's package there, FURCATE_TOKENIZER_DIR names a folder with its tokenizer files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import HFReference
from furcate.runtime.engine.engine import Engine
from tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh)")

# flashinfer has no float32 kernels nor head_dim 16/32 (the tiny models'): its engine check against HF, in bf16 on
# head_dim 64, is tests/test_flashinfer_backend.py's.
BACKENDS = ["torch_native", "triton"]
PROMPTS = [[1, 5, 9, 200, 31, 7], [1, 5, 9, 200, 31, 7, 44, 45], list(range(3, 70)), [1, 2000, 3000]]


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory, request) -> dict[str, Path]:
    tokenizer_dir = os.environ.get("FURCATE_TOKENIZER_DIR")
    tokenizer = Path(tokenizer_dir) if tokenizer_dir else request.getfixturevalue("default_model_dir")
    root = tmp_path_factory.mktemp("gpu")
    return {arch: build_tiny_model(arch, root / arch, tokenizer) for arch in ("llama", "mistral", "qwen3")}


@pytest.fixture(scope="module")
def references(gpu_models) -> dict[str, list[list[int]]]:
    """HF transformers greedy continuations on the CPU, float32."""
    return {arch: [HFReference(path).greedy(p, 12) for p in PROMPTS] for arch, path in gpu_models.items()}


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_greedy_equals_hf_on_gpu(gpu_models, references, arch, backend, graphs):
    with Engine(str(gpu_models[arch]), device="cuda", dtype="float32", attention_backend=backend,
                disable_cuda_graph=not graphs, disable_overlap_schedule=False, chunked_prefill_size=16,
                max_total_tokens=8192, cuda_graph_max_bs=16) as engine:
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        for _ in range(2):  # the second round is served from the radix cache
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=[params] * len(PROMPTS))
            assert [out["output_ids"] for out in outputs] == references[arch]
        assert engine.check_integrity()


def test_grammar_and_sampling_on_gpu(gpu_models):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with Engine(str(gpu_models["llama"]), device="cuda", disable_overlap_schedule=False,
                max_total_tokens=8192) as engine:
        out = engine.generate("Give a number:", {"max_new_tokens": 32, "json_schema": json.dumps(schema)})
        assert isinstance(json.loads(out["text"])["n"], int)
        params = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "sampling_seed": 3}
        first, second = (engine.generate("Once upon a time", params)["output_ids"] for _ in range(2))
        assert first == second and len(first) == 16
        assert engine.get_stats()["running"] == 0
