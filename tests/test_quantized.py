"""GGUF weights run quantized: blocks read back exactly, kernels agree with dense matmuls, engines over a tiny
GGUF written here and over the default model stay close to their dequantized selves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from benchmarks.precision_quality import chat_ids, greedy, measure, reference_logprobs
from conftest import NO_GRAMMAR, assert_pool_free, engines_side_by_side
from furcate import Engine
from furcate.runtime.model.kernel_choice import ROW_LADDER, small_batch_rows
from furcate.runtime.model.weights.default_model import find_default_gguf, prepare_user_gguf
from furcate.runtime.model.weights.gguf_arch import ARCHS, unpermute_rope
from furcate.runtime.model.weights.loader import load_model
from furcate.runtime.model.weights.quantize import gguf_block_weights, measured_quantization
from furcate.runtime.model.weights.quantized import Int4Linear, Int8Linear, SmallBatchQuantized, read_blocks
from tiny_gguf import HEADS, KV_HEADS, QUANTIZED_LAYERS, build_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", find_default_gguf())



def test_blocks_dequantize_as_gguf_does(tiny_gguf):
    blocks = gguf_block_weights(tiny_gguf)
    heads = {"q_proj": HEADS, "k_proj": KV_HEADS}
    seen = set()
    for tensor in GGUFReader(tiny_gguf).tensors:
        name = ARCHS["llama"].hf_name(tensor.name)
        if tensor.tensor_type.name == "F32":
            assert name not in blocks
            continue
        expected = dequantize(tensor.data, tensor.tensor_type)
        if name.split(".")[-2] in heads:
            expected = unpermute_rope(expected, heads[name.split(".")[-2]])
        np.testing.assert_allclose(blocks[name].dequantize().numpy(), expected, rtol=1e-6, atol=1e-7)
        seen.add(blocks[name].kind)
    assert seen == {"Q4_0", "Q4_1", "Q8_0"}


def _random_blocks(kind: str, rows: int, cols: int):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weight = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    return read_blocks(kind, quantize(weight, GGMLQuantizationType[kind]), rows, cols)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_kernels_match_a_dense_matmul(kind):
    blocks = _random_blocks(kind, 96, 128)
    layer = (Int8Linear if kind == "Q8_0" else Int4Linear)(blocks, None)
    x = torch.randn(5, 128)
    dense = x @ blocks.dequantize().T
    got = layer(x)
    assert got.shape == dense.shape and got.dtype == x.dtype
    # bfloat16 activations and scales (and Q8_0's per-row requantization) round; the result must stay within
    # a few bfloat16 ulps of the matmul's scale.
    assert (got - dense).abs().max() <= 0.02 * dense.abs().max()


def test_small_batches_take_the_quantized_kernel_and_larger_ones_the_dense_layer():
    blocks = _random_blocks("Q4_1", 64, 64)
    dense = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        dense.weight.copy_(blocks.dequantize())
    layer = SmallBatchQuantized(Int4Linear(blocks, None), dense, max_rows=8)
    small, large = torch.randn(8, 64), torch.randn(9, 64)
    assert torch.equal(layer(small), layer.quantized(small))
    assert torch.equal(layer(large), dense(large))


class Twice(torch.nn.Module):
    """A layer that does the dense layer's work twice: slower than it at every size."""

    def __init__(self, dense: torch.nn.Linear) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.dense(x))


def test_auto_measures_which_batch_sizes_the_quantized_kernel_serves():
    dense = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)]
    # Kernels always slower than the dense layers serve no batch; ones always far faster serve every rung.
    assert small_batch_rows([Twice(layer) for layer in dense], dense) == 0
    # (No work at all: a cheap real layer's few microseconds lost a rung to one burst of load on 2 cores.)
    assert small_batch_rows([torch.nn.Identity() for _ in dense], dense) == ROW_LADDER[-1]


def test_auto_measures_once_per_machine_and_reads_the_choice_back(private_cache, idle_machine, monkeypatch):
    """A choice measured again at every start moved with load (4 rows one start, 8 the next), and the compiled
    graphs that bake it in were never found again; a damaged record is measured again."""
    from furcate.runtime.model import kernel_choice

    measured = []
    monkeypatch.setattr(kernel_choice, "small_batch_rows", lambda q, d: measured.append(len(d)) or 4 + len(measured))
    dense = [torch.nn.Linear(64, 64, bias=False) for _ in range(3)]
    quantized = [torch.nn.Identity() for _ in dense]
    assert kernel_choice.remembered_rows(quantized, dense) == 5
    assert kernel_choice.remembered_rows(quantized, dense) == 5
    assert kernel_choice.remembered_rows(quantized, dense[:2]) == 6  # other shapes: their own choice
    assert len(measured) == 2
    kernel_choice.choice_file(quantized, dense).write_text("{not json")
    assert kernel_choice.remembered_rows(quantized, dense) == 7
    assert kernel_choice.remembered_rows(quantized, dense) == 7


def test_auto_on_the_default_model_times_its_mlps_and_keeps_what_won(default_model_dir, private_cache):
    model = load_model(str(default_model_dir), torch.bfloat16)
    layers = model.model.layers
    dense_mlp = layers[0].mlp.gate_up_proj
    result = measured_quantization(model, gguf_block_weights(find_default_gguf()))
    assert result.max_rows in (0, *ROW_LADDER)
    if result.max_rows:  # every quantizable layer swapped, each serving up to the measured rows
        assert len(result.layers) == 4 * len(layers) + 1
        assert layers[0].mlp.gate_up_proj.max_rows == result.max_rows
        assert layers[0].mlp.gate_up_proj.dense is dense_mlp
    else:  # the dense layers are back, untouched
        assert result.layers == [] and layers[0].mlp.gate_up_proj is dense_mlp


def _prompt_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                          logprob_start_len=1)
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_on_a_quantized_gguf_stays_close_to_its_dequantized_weights(tiny_gguf, private_cache, dtype):
    ids = list(range(100, 160))
    results = {}
    kinds = ("gguf", "none")
    prepare_user_gguf(str(tiny_gguf))  # converted once, before the two engines start side by side
    with engines_side_by_side(*[(str(tiny_gguf), {"dtype": dtype, "quantization": quantization,
                                                  "max_total_tokens": 2000, "torch_num_threads": 2, **NO_GRAMMAR})
                                for quantization in kinds]) as engines:
        for quantization, engine in zip(kinds, engines):
            assert engine.info.quantized_layers == (QUANTIZED_LAYERS if quantization == "gguf" else 0)
            assert engine.info.dtype == dtype
            results[quantization] = _prompt_logprobs(engine, ids)
            assert_pool_free(engine)
    # Logprobs of this random model average about -14; the quantized kernels move them by a fraction of one.
    assert (results["gguf"] - results["none"]).abs().max() < 0.3


def test_quantization_gguf_refuses_a_plain_model_directory(tiny_model_dirs):
    with pytest.raises(Exception, match="quantization='gguf' needs a model given as a .gguf file"):
        Engine(str(tiny_model_dirs["llama"]), quantization="gguf", max_total_tokens=500, torch_num_threads=1)


def test_default_model_quantized_agrees_with_its_float32_self(default_engine):
    """The default model's Q4_1 layers and Q8_0 head on the int4/int8 kernels: greedy agreement and teacher-
    forced logprobs against float32 (precision_quality.py measures the same on more prompts)."""
    prompts = ["What is the capital of France?", "List three uses of copper.", "Why is the sky blue?",
               "Write a haiku about winter."]
    ids = [chat_ids(default_engine, p) for p in prompts]  # the shared float32 engine is the reference
    reference = greedy(default_engine, ids, 24)
    scores = reference_logprobs(default_engine, ids, reference)
    assert_pool_free(default_engine)
    with Engine("default", dtype="bfloat16", quantization="gguf", max_total_tokens=4096,
                torch_num_threads=2, **NO_GRAMMAR) as engine:
        assert engine.info.quantized_layers == 30 * 4 + 1
        quality = measure(engine, ids, reference, scores)
        assert_pool_free(engine)
    # Measured on this model: mean 0.035, agreement 0.77 over 8 prompts x 48 tokens.
    assert quality.mean_abs_logprob_diff < 0.1
    assert quality.greedy_agreement >= 0.5
