"""Qwen3-MoE (a dense layer among sparse ones; top-k weights renormalised or not), Mixtral (sliding window),
OLMoE (q/k norms over whole projections, q/k/v clipping) and Qwen2-MoE (shared expert, q/k/v biases) served end
to end: greedy output equals HF transformers' on tiny random weights in float32 with the radix cache on (chunked
prefill, cache hits) and off, and with tensor parallelism over two processes. A checkpoint lacking one expert is
refused by name; weight updates reach an expert's slot; compiled decode and CUDA graphs refuse MoE models."""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from conftest import engine_starting
from furcate.runtime.distributed.parallel_state import TensorParallel
from furcate.runtime.executor.compiled_decode import compilable
from furcate.runtime.executor.cuda_graph_runner import capturable
from furcate.runtime.model.moe import SparseMoE
from furcate.runtime.model.weights.checkpoint import check_tp_size, load_config
from furcate.runtime.model.weights.loader import load_model
from furcate.runtime.model.weights.weight_update import WeightWriter
from furcate.runtime.wire.tensor_specs import TensorSpec
from test_families import (
    ENGINE_ARGS,
    assert_greedy_equals_hf,
    assert_tensor_parallel_greedy_equals_hf,
    generate_all,
    hf_outputs,
)
from tiny_models import COMMON, build_tiny_model

MOE = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "tie_word_embeddings": False}
MODEL_CONFIGS = {
    # Layer 1 dense (a GatedMLP of intermediate_size 128), layer 0 sparse.
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON | MOE, num_experts=8, moe_intermediate_size=32, head_dim=16,
                                        mlp_only_layers=[1], norm_topk_prob=True),
    # Layer 0 dense, layer 1 sparse, by decoder_sparse_step; top-k weights as the softmax gave them.
    "qwen3_moe_unnormed": lambda: Qwen3MoeConfig(**COMMON | MOE, num_experts=4, moe_intermediate_size=32,
                                                 decoder_sparse_step=2, norm_topk_prob=False),
    # A window the prompts cross.
    "mixtral": lambda: MixtralConfig(**COMMON | MOE | {"intermediate_size": 32}, num_local_experts=4,
                                     sliding_window=24),
    # Clipping at 1.5 clamps a share of q, k and v (their entries are ~1 to ~3 at these weights).
    "olmoe": lambda: OlmoeConfig(**COMMON | MOE | {"intermediate_size": 32}, num_experts=8, clip_qkv=1.5),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON | MOE, num_experts=4, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48),
}
MODEL_NAMES = sorted(MODEL_CONFIGS)
# Models whose difference is routing arithmetic alone, which the cache never sees: one engine, radix off.
ROUTING_VARIANTS = ("qwen3_moe_unnormed",)
TP_MODELS = ("mixtral", "qwen3_moe")
MISSING = "model.layers.1.block_sparse_moe.experts.2.w3.weight"  # Mixtral's up projection of expert 2


def build_moe_model(name: str, directory: Path, tokenizer_dir: Path) -> Path:
    """HF initialises biases to zero: random ones here, so Qwen2-MoE's q/k/v biases must land where HF's do."""
    build_tiny_model(name, directory, tokenizer_dir, config=MODEL_CONFIGS[name]())
    path = directory / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    for key in [key for key in tensors if key.endswith(".bias")]:
        tensors[key] = torch.randn(tensors[key].shape, generator=generator) * 0.3
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_models")
    return {name: build_moe_model(name, root / name, default_model_dir) for name in MODEL_NAMES}


@pytest.fixture(scope="module")
def expected(model_dirs, tokenizer):
    """HF's greedy outputs per model, as test_families computes them (once, on first use)."""
    return cache(lambda name: hf_outputs(model_dirs[name], tokenizer))


@pytest.mark.parametrize("name", [name for name in MODEL_NAMES if name not in ROUTING_VARIANTS])
def test_moe_greedy_equals_hf(name, model_dirs, expected):
    assert_greedy_equals_hf(model_dirs[name], lambda: expected(name))


@pytest.mark.parametrize("name", ROUTING_VARIANTS)
def test_moe_routing_variant_greedy_equals_hf(name, model_dirs, expected):
    with engine_starting(str(model_dirs[name]), **ENGINE_ARGS, disable_radix_cache=True) as started:
        reference = expected(name)
        assert generate_all(started())[0] == reference


@pytest.mark.parametrize("name", TP_MODELS)
def test_moe_tensor_parallel_greedy_equals_hf(name, model_dirs, expected):
    assert_tensor_parallel_greedy_equals_hf(model_dirs[name], lambda: expected(name))


def test_a_checkpoint_missing_an_expert_is_refused_by_name(model_dirs, tmp_path):
    shutil.copytree(model_dirs["mixtral"], tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[MISSING]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors for.*model\.layers\.1\.mlp\.w_gate_up \(experts \[2\]\)"):
        load_model(str(tmp_path), torch.float32)


def test_compiled_decode_and_cuda_graphs_refuse_moe_models(model_dirs):
    model = load_model(str(model_dirs["qwen3_moe"]), torch.float32)
    assert isinstance(model.model.layers[0].mlp, SparseMoE) and not isinstance(model.model.layers[1].mlp, SparseMoE)
    assert "mixture-of-experts" in compilable(model)
    assert "mixture-of-experts" in capturable(model)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_weight_update_lands_in_its_slot(model_dirs, rank):
    """A trainer's per-expert tensor, whole: each of two ranks keeps its columns of expert 3's gate rows."""
    model = load_model(str(model_dirs["qwen3_moe"]), torch.float32, tp=TensorParallel(rank, 2))
    writer = WeightWriter(model)
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    new = torch.randn(32, 64)
    placements = writer.plan([TensorSpec(name, torch.float32, (32, 64))])
    writer.write(placements, [new])
    assert torch.equal(writer.read(name), new.chunk(2)[rank])
    assert torch.equal(model.model.layers[0].mlp.w_gate_up[3, :16], new.chunk(2)[rank])
    with pytest.raises(ValueError, match="does not fit"):
        writer.plan([TensorSpec(name, torch.float32, (30, 64))])
    with pytest.raises(ValueError, match="expert 8 out of range"):
        writer.plan([TensorSpec(name.replace(".3.", ".8."), torch.float32, (32, 64))])


def test_tp_size_must_divide_the_experts_intermediate_size(model_dirs):
    config = load_config(str(model_dirs["qwen2_moe"]))
    check_tp_size(config, 2)
    config.shared_expert_intermediate_size = 51
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(51\)"):
        check_tp_size(config, 2)
