"""GGUF files beyond llama: each architecture furcate converts, written from a tiny random HF model the way
llama.cpp writes it, converts back to that model's tensors and config (and to transformers' own GGUF tensors);
each runs greedy on the engine exactly as HF generate does on the original. Q4_K blocks run on the int4 kernel
as gguf.quants dequantizes them, Q6_K ones dense; unknown and broken files are clear errors; furcate's own GGUF
reader reads what gguf's does."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from conftest import EXACT, NO_GRAMMAR, assert_pool_free, engine_starting, engines_side_by_side
from furcate.runtime.model.weights.default_model import find_default_gguf, prepare_gguf_model, prepare_user_gguf
from furcate.runtime.model.weights.gguf_arch import open_gguf
from furcate.runtime.model.weights.gguf_reader import read_gguf
from furcate.runtime.model.weights.quantize import gguf_block_weights
from furcate.runtime.model.weights.quantized import Int4Linear, read_blocks
from tiny_gguf_families import CONFIGS, build_hf_model, quantize_q4_k, quantize_q6_k, write_gguf

ARCHS = sorted(CONFIGS)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# Every converted architecture runs on the engine, greedy-equal to HF on the original model.
ENGINE_ARCHS = ARCHS
CONFIG_FIELDS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                 "rope_parameters", "tie_word_embeddings", "sliding_window", "layer_types", "attn_logit_softcapping",
                 "final_logit_softcapping", "query_pre_attn_scalar", "original_max_position_embeddings",
                 "bos_token_id", "eos_token_id", "pad_token_id"]
PROMPTS = [[100, 2000, 31, 7, 900], list(range(300, 340)), [5000]]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """arch -> (HF model, its GGUF, the converted directory)."""
    root = tmp_path_factory.mktemp("families")
    built = {}
    for arch in ARCHS:
        model = build_hf_model(arch)
        gguf = write_gguf(model, arch, root / f"{arch}.gguf", find_default_gguf())
        built[arch] = model, gguf, prepare_gguf_model(gguf, arch, str(root / "cache"), progress=None)
    return built


def _hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint of `model` holds (a tied LM head is the embedding, stored once)."""
    tied = model.config.tie_word_embeddings
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_gives_back_the_hf_models_tensors(arch, families):
    model, _, converted = families[arch]
    got, expected = load_file(converted / "model.safetensors"), _hf_state(model)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        # Gemma's norms come back as (w + 1) - 1 in float32: within an ulp of 1.
        tolerance = 1.2e-7 if arch.startswith("gemma") and "norm" in name else 0.0
        assert (got[name] - tensor).abs().max().item() <= tolerance, name


@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_gives_back_the_hf_models_config(arch, families):
    model, _, converted = families[arch]
    config = AutoConfig.from_pretrained(converted)
    assert config.architectures == [HF_ARCHITECTURES[arch]]
    for field in CONFIG_FIELDS:
        assert getattr(config, field, None) == getattr(model.config, field, None), field


@pytest.mark.parametrize("arch", ARCHS)
def test_tensors_are_the_ones_transformers_loads_from_the_gguf(arch, families):
    _, gguf, converted = families[arch]
    theirs = load_gguf_checkpoint(str(gguf), return_tensors=True,
                                  model_to_load=AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(converted)))
    ours = load_file(converted / "model.safetensors")
    assert sorted(theirs["tensors"]) == sorted(ours)
    assert all(torch.equal(theirs["tensors"][name], ours[name]) for name in ours)


# Families whose GGUFs hold byte-level BPE vocabularies, as the tiny ones do (SmolLM2's with the "smollm" split
# rule, or qwen2's); Gemma's and Phi-3's real files hold sentencepiece ones, which transformers' Gemma tokenizer
# class is for, not SmolLM2's.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_converted_tokenizer_encodes_as_the_default_models(arch, families, tokenizer):
    text = "Old machines sang over the river, 3 times in 1969."
    assert AutoTokenizer.from_pretrained(families[arch][2]).encode(text) == tokenizer.encode(text)


def _hf_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_engine_on_the_gguf_is_greedy_as_hf_on_the_original_model(arch, families, private_cache):
    model, gguf, _ = families[arch]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with engine_starting(str(gguf), **EXACT, **NO_GRAMMAR, max_total_tokens=1000, torch_num_threads=1) as started:
        expected = [_hf_greedy(model, prompt, 12) for prompt in PROMPTS]  # while the engine starts
        engine = started()
        assert [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=params)] == expected
        assert_pool_free(engine)


def _unknown_arch_gguf(path) -> str:
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unknown_architecture_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba'; furcate reads \['gemma2'"):
        prepare_gguf_model(_unknown_arch_gguf(tmp_path / "mamba.gguf"), "mamba", str(tmp_path), progress=None)


@pytest.mark.parametrize("keep", [0, 100, 0.7])
def test_a_truncated_file_is_a_clear_error(families, tmp_path, keep):
    data = families["llama"][1].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        prepare_gguf_model(cut, "cut", str(tmp_path), progress=None)
    assert not (tmp_path / "models" / "cut").exists()


# Q4_K and Q6_K: rows of 256-weight super-blocks.
K_WIDTH = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}

def _weights(rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    # A column-dependent shift, so sub-blocks have minimums of either sign.
    return (rng.standard_normal((rows, cols)) * 0.3 + np.linspace(-0.2, 0.4, cols)).astype(np.float32)


@pytest.mark.parametrize("kind, quantize", [("Q4_K", quantize_q4_k), ("Q6_K", quantize_q6_k)])
def test_hand_written_k_blocks_dequantize_close_to_their_weights(kind, quantize):
    weight = _weights(16, 512)
    restored = dequantize(quantize(weight), Q[kind])
    assert restored.shape == weight.shape
    # Within about a step of the grid (4 bits over a sub-block's range, 6 over a group's) of every weight.
    assert np.abs(restored - weight).max() < {"Q4_K": 0.06, "Q6_K": 0.03}[kind] * np.abs(weight).max()


def test_q4_k_blocks_dequantize_exactly_as_gguf_does():
    weight = _weights(48, 768)
    raw = quantize_q4_k(weight)
    blocks = read_blocks("Q4_K", raw, 48, 768)
    assert blocks.q.min() >= 0 and blocks.q.max() <= 15 and blocks.scale.shape == (48, 768 // 32)
    np.testing.assert_array_equal(blocks.dequantize().numpy(), dequantize(raw, Q.Q4_K))


def test_q4_k_on_the_int4_kernel_rounds_only_its_scales_to_bfloat16():
    blocks = read_blocks("Q4_K", quantize_q4_k(_weights(64, 512)), 64, 512)
    layer = Int4Linear(blocks, None)
    scale, zero = layer.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, K / 32] each
    groups = torch.from_numpy(blocks.q).reshape(64, -1, 32).float()
    kernel_weight = ((groups - 8) * scale[..., None] + zero[..., None]).reshape(64, 512)
    exact = blocks.dequantize()
    # bfloat16 keeps 8 significant bits: scale and zero each within 2^-9 of themselves.
    assert torch.allclose(scale, torch.from_numpy(blocks.scale), rtol=2**-8, atol=0)
    assert (kernel_weight - exact).abs().max() < 2**-7 * exact.abs().max()
    x = torch.randn(5, 512)
    assert (layer(x) - x @ exact.T).abs().max() <= 0.02 * (x @ exact.T).abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_quantized_blocks_are_the_converted_tensors(arch, tmp_path):
    """The quantized path names and orders rows as the conversion does: llama's q/k unpermuted, qwen3's and
    Phi-3's fused ones as written."""
    # The tiny Phi-3's LongRoPE factors are for head_dim 16; these heads are 64 wide.
    plain_rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}} if arch == "phi3" else {}
    model = build_hf_model(arch, **K_WIDTH, **plain_rope)
    gguf = write_gguf(model, arch, tmp_path / f"{arch}.gguf", find_default_gguf(), types=lambda name: Q.Q4_K)
    dense = load_file(prepare_gguf_model(gguf, arch, str(tmp_path), progress=None) / "model.safetensors")
    blocks = gguf_block_weights(gguf)
    assert sorted(blocks) == sorted(name for name, t in dense.items() if t.dim() == 2)
    assert all(torch.equal(b.dequantize(), dense[name]) for name, b in blocks.items())


# A Q4_K_M-like mix: layer 0's attn_v and ffn_down and the LM head Q6_K, every other 2-D weight Q4_K.


def _k_type(name: str) -> Q:
    return Q.Q6_K if name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight", "output.weight") else Q.Q4_K


# Layer 0: o_proj and gate_up (its qkv mixes Q4_K and Q6_K, its down is Q6_K); layer 1: qkv, o, gate_up, down.
K_QUANTIZED_LAYERS = 2 + 4


def test_engine_on_q4_k_and_q6_k_is_greedy_as_on_its_dequantized_weights(tmp_path, private_cache):
    model = build_hf_model("llama", **K_WIDTH)
    gguf = write_gguf(model, "llama", tmp_path / "k-quants.gguf", find_default_gguf(), types=_k_type)
    assert {t.tensor_type.name for t in GGUFReader(gguf).tensors} == {"F32", "Q4_K", "Q6_K"}
    prepare_user_gguf(str(gguf))  # converted once, before the two engines start side by side
    kinds = ("gguf", "none")
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    args = {"dtype": "float32", "max_total_tokens": 1000, "torch_num_threads": 1, **NO_GRAMMAR}
    with engines_side_by_side(*[(str(gguf), {**args, "quantization": kind}) for kind in kinds]) as engines:
        assert [e.info.quantized_layers for e in engines] == [K_QUANTIZED_LAYERS, 0]
        outputs = [[r["output_ids"] for r in e.generate(input_ids=PROMPTS, sampling_params=params)]
                   for e in engines]
        for engine in engines:
            assert_pool_free(engine)
    assert outputs[0] == outputs[1]


def test_the_fast_reader_reads_what_gguf_reads(tmp_path):
    """furcate's reader against gguf's GGUFReader on the default model (Q4_1, Q8_0, F32) and a file of Q4_K and
    Q6_K blocks: every metadata value (long string arrays as their lengths), every tensor's name, type, shape,
    numpy view and bytes."""
    k_file = write_gguf(build_hf_model("llama", **K_WIDTH), "llama", tmp_path / "k.gguf", find_default_gguf(),
                        types=_k_type)
    for path in (find_default_gguf(), k_file):
        ours, theirs = read_gguf(str(path)), GGUFReader(path)
        for key, field in theirs.fields.items():
            if not key.startswith("GGUF."):  # the header, which GGUFReader lists as fields
                mine, value = ours.values[key], field.contents()
                if isinstance(mine, np.ndarray):  # a long scalar array (token types), kept as a view
                    assert np.array_equal(mine, value), key
                else:
                    assert mine == (len(value) if isinstance(mine, int) and isinstance(value, list) else value), key
        assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [
            (t.name, t.tensor_type, tuple(int(n) for n in t.shape)) for t in theirs.tensors]
        for mine, reference in zip(ours.tensors, theirs.tensors):
            assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
            assert np.array_equal(mine.data.view(np.uint8), reference.data.view(np.uint8)), mine.name


def _header(tensors: int, values: int, version: int = 3) -> bytes:
    return struct.pack("<4sIQQ", b"GGUF", version, tensors, values)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


HOSTILE = {
    "a string of 2^60 bytes": _header(0, 1) + _key("general.name") + struct.pack("<IQ", 8, 2**60),
    "2^60 tensors": _header(2**60, 0),
    "an array of 2^60 floats": _header(0, 1) + _key("x") + struct.pack("<IIQ", 9, 6, 2**60),
    "alignment 0": _header(0, 1) + _key("general.alignment") + struct.pack("<II", 4, 0),
    "big-endian": struct.pack(">4sIQQ", b"GGUF", 3, 0, 0),
    "a Q4_K row of 100 weights": _header(1, 0) + _key("blk.0.attn_q.weight")
    + struct.pack("<I2QIQ", 2, 100, 4, int(Q.Q4_K), 0) + bytes(64),
    "arrays nested 2^20 deep": _header(0, 1) + _key("x") + struct.pack("<II", 9, 9) * 2**20,
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_a_clear_error_at_once(case, tmp_path):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE[case])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(path)
