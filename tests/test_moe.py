"""SparseMoE (runtime/model/moe.py) against transformers' own MoE blocks: the same random weights, loaded through
our checkpoint-name mapping, give HF's outputs (float32 to 1e-5, bfloat16 loosely), also split over two
tensor-parallel ranks; dense-or-sparse layers follow HF's rule; bad checkpoint names fail clearly."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

from furcate.runtime.distributed.parallel_state import SINGLE, TensorParallel
from furcate.runtime.model import moe
from furcate.runtime.model.families import MOE_STYLES
from furcate.runtime.model.moe import SparseMoE, moe_placement, split_moe_name

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# name: (architecture, HF block class, config factory); the experts' intermediate sizes are split by tp 2.
FAMILIES: dict[str, tuple[str, type, Callable[..., object]]] = {
    "qwen3": ("Qwen3MoeForCausalLM", Qwen3MoeSparseMoeBlock, lambda **kw: Qwen3MoeConfig(**COMMON | dict(
        num_experts=8, moe_intermediate_size=32, intermediate_size=96, head_dim=16) | kw)),
    "qwen2": ("Qwen2MoeForCausalLM", Qwen2MoeSparseMoeBlock, lambda **kw: Qwen2MoeConfig(**COMMON | dict(
        num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96) | kw)),
    "mixtral": ("MixtralForCausalLM", MixtralSparseMoeBlock, lambda **kw: MixtralConfig(**COMMON | dict(
        num_local_experts=4, intermediate_size=64) | kw)),
    "olmoe": ("OlmoeForCausalLM", OlmoeSparseMoeBlock, lambda **kw: OlmoeConfig(**COMMON | dict(
        num_experts=8, intermediate_size=32) | kw)),
}
# (family, config overrides): both routings of Qwen3-MoE, one with top-3 (three terms per token's sum).
CASES = [("qwen3", {"norm_topk_prob": True}), ("qwen3", {"norm_topk_prob": False}),
         ("qwen3", {"norm_topk_prob": True, "num_experts_per_tok": 3}), ("qwen2", {"norm_topk_prob": False}),
         ("qwen2", {"norm_topk_prob": True}), ("mixtral", {}), ("olmoe", {"norm_topk_prob": False}),
         ("olmoe", {"norm_topk_prob": True})]
CASE_IDS = [family + "".join(f"-{key}={value}" for key, value in overrides.items()) for family, overrides in CASES]
TOKENS = (1, 7, 33)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The blocks are tiny: more threads only contend (the module took 3x longer on a busy 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def hf_block(family: str, implementation: str = "grouped_mm", **overrides) -> tuple[torch.nn.Module, object]:
    """HF's block of a tiny config with random weights (initializer_range's scale), and the config."""
    _, block_class, make_config = FAMILIES[family]
    config = make_config(**overrides)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = block_class(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=config.initializer_range)
    return block.eval(), config


def our_block(family: str, config, tensors: Mapping[str, torch.Tensor], tp: TensorParallel = SINGLE,
              dtype: torch.dtype = torch.float32) -> SparseMoE:
    """A SparseMoE filled from HF-named tensors through moe_placement. Every parameter starts as NaN, so a place
    no tensor reached shows in the outputs."""
    style = MOE_STYLES[FAMILIES[family][0]]
    block = SparseMoE(config, style, tp).to(dtype)
    params = dict(block.named_parameters())
    with torch.no_grad():
        for param in params.values():
            param.fill_(float("nan"))
    for name, tensor in tensors.items():
        place = moe_placement(style, name)
        place.load(params[place.param], tensor, tp)
    return block.eval()


def hidden_states(tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)


def hf_output(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x[None])[0]


def our_output(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x)


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family, overrides", CASES, ids=CASE_IDS)
def test_float32_matches_hf_block(family, overrides, implementation):
    """HF's in-memory (stacked) tensors; HF's default grouped_mm experts path and its eager loop alike."""
    reference, config = hf_block(family, implementation, **overrides)
    block = our_block(family, config, reference.state_dict())
    for tokens in TOKENS:
        x = hidden_states(tokens)
        torch.testing.assert_close(our_output(block, x), hf_output(reference, x), atol=1e-5, rtol=1e-5)



def layer0_tensors(style: moe.MoeStyle, path) -> dict[str, torch.Tensor]:
    """Layer 0's MoE tensors of a safetensors file, named within the block."""
    tensors = {}
    for name, tensor in load_file(path).items():
        parts = split_moe_name(style, name)
        if parts is not None and parts[0] == "model.layers.0":
            tensors[parts[1]] = tensor
    return tensors


@pytest.fixture(scope="module")
def saved_blocks(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, object, dict[str, torch.Tensor]]]:
    """Per family: a tiny HF model's layer-0 block, its config, and its tensors as save_pretrained wrote them."""
    saved = {}
    for family, (architecture, _, make_config) in FAMILIES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config()).eval()
        directory = tmp_path_factory.mktemp(family)
        model.save_pretrained(directory)
        tensors = layer0_tensors(MOE_STYLES[architecture], directory / "model.safetensors")
        saved[family] = model.model.layers[0].mlp, model.config, tensors
    return saved


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_saved_checkpoint_loads_through_the_name_mapping(family, saved_blocks):
    """This transformers version saves experts one by one (Mixtral's as block_sparse_moe.experts.N.w1/w2/w3)."""
    reference, config, tensors = saved_blocks[family]
    gate, _, _ = MOE_STYLES[FAMILIES[family][0]].expert_names
    assert f"experts.0.{gate}.weight" in tensors and "gate.weight" in tensors
    block = our_block(family, config, tensors)
    for tokens in TOKENS:
        x = hidden_states(tokens)
        torch.testing.assert_close(our_output(block, x), hf_output(reference, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_tensor_parallel_shards_sum_to_hf_block(family, saved_blocks):
    """Each rank's partial output (before the all_reduce) from its half of every expert; the sum is the block."""
    reference, config, tensors = saved_blocks[family]
    shards = [our_block(family, config, tensors, TensorParallel(rank, 2)) for rank in range(2)]
    full = getattr(config, MOE_STYLES[FAMILIES[family][0]].intermediate_field)
    assert shards[0].w_down.shape[-1] == full // 2
    for tokens in TOKENS:
        x = hidden_states(tokens)
        with torch.no_grad():
            summed = sum(shard.partial(x) for shard in shards)
        torch.testing.assert_close(summed, hf_output(reference, x), atol=1e-5, rtol=1e-5)


def test_stacked_tensors_split_gate_and_up_each_across_ranks():
    """HF's stacked [E, 2I, H] gate_up: a rank's rows are its gate columns then its up columns."""
    reference, config = hf_block("qwen3")
    shards = [our_block("qwen3", config, reference.state_dict(), TensorParallel(rank, 2)) for rank in range(2)]
    for tokens in TOKENS:
        x = hidden_states(tokens)
        with torch.no_grad():
            summed = shards[0].partial(x) + shards[1].partial(x)
        torch.testing.assert_close(summed, hf_output(reference, x), atol=1e-5, rtol=1e-5)


def test_forward_all_reduces_once(monkeypatch):
    """Routed and shared experts share one all_reduce, whose in-place sum is forward's output. (The reduce's stand-in
    adds rank 1's partial output: a real gloo group would cost two processes' ~5 s start.)"""
    reference, config = hf_block("qwen2")
    shards = [our_block("qwen2", config, reference.state_dict(), TensorParallel(rank, 2)) for rank in range(2)]
    x, reduced = hidden_states(7), []

    def all_reduce(tensor: torch.Tensor) -> None:
        reduced.append(tensor)
        tensor += shards[1].partial(x)

    monkeypatch.setattr(moe.dist, "all_reduce", all_reduce)
    out = our_output(shards[0], x)
    assert len(reduced) == 1 and reduced[0] is out
    torch.testing.assert_close(out, hf_output(reference, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_is_close_to_hf_block(family, implementation):
    """HF's eager loop rounds to bfloat16 after each expert's add, its grouped_mm path (and ours) once."""
    reference, config = hf_block(family, implementation)
    reference = reference.to(torch.bfloat16)
    block = our_block(family, config, reference.state_dict(), dtype=torch.bfloat16)
    for tokens in TOKENS:
        x = hidden_states(tokens, torch.bfloat16)
        expected, got = hf_output(reference, x), our_output(block, x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max())


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3"])
def test_bfloat16_is_hf_default_path_bit_for_bit(family):
    """The same ops in the same dtypes as HF's grouped_mm path: Mixtral's float32 top-k weights and the others'
    bfloat16 ones show. (Qwen2-MoE's fused shared gate/up matmul may round differently from HF's two.)"""
    reference, config = hf_block(family)
    reference = reference.to(torch.bfloat16)
    block = our_block(family, config, reference.state_dict(), dtype=torch.bfloat16)
    for tokens in TOKENS:
        x = hidden_states(tokens, torch.bfloat16)
        assert torch.equal(our_output(block, x), hf_output(reference, x)), tokens


def test_expert_loop_without_grouped_mm_matches(monkeypatch):
    """Where grouped_mm has no kernel (CUDA in float32), a loop over the experts that have tokens."""
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda x: False)
    reference, config = hf_block("qwen2")
    block = our_block("qwen2", config, reference.state_dict())
    for tokens in TOKENS:
        x = hidden_states(tokens)
        torch.testing.assert_close(our_output(block, x), hf_output(reference, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (1, [0, 3]), (2, [1])])
def test_sparse_layers_follow_hf(step, dense):
    config = FAMILIES["qwen3"][2](num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=dense)
    style = MOE_STYLES["Qwen3MoeForCausalLM"]
    for layer_id in range(4):
        hf_sparse = isinstance(Qwen3MoeDecoderLayer(config, layer_id).mlp, Qwen3MoeSparseMoeBlock)
        assert style.is_sparse_layer(config, layer_id) == hf_sparse, layer_id
    assert all(MOE_STYLES["MixtralForCausalLM"].is_sparse_layer(FAMILIES["mixtral"][2](), i) for i in range(2))


@pytest.mark.parametrize("architecture, name", [
    ("Qwen3MoeForCausalLM", "experts.0.w1.weight"),  # Mixtral's name
    ("Qwen3MoeForCausalLM", "shared_expert_gate.weight"),  # only Qwen2-MoE has a shared expert
    ("MixtralForCausalLM", "experts.0.gate_proj.weight"),
    ("OlmoeForCausalLM", "experts.x.gate_proj.weight"),
    ("Qwen2MoeForCausalLM", "gate_proj.weight"),  # a dense layer's MLP
])
def test_unknown_checkpoint_name_is_a_clear_error(architecture, name):
    with pytest.raises(ValueError, match="is no tensor of a .* MoE block"):
        moe_placement(MOE_STYLES[architecture], name)


def test_misfitting_tensors_are_clear_errors():
    _, config = hf_block("olmoe")
    style = MOE_STYLES["OlmoeForCausalLM"]
    block = SparseMoE(config, style)
    place = moe_placement(style, "experts.8.up_proj.weight")
    with pytest.raises(ValueError, match="expert 8 out of range"):
        place.load(block.w_gate_up, torch.zeros(32, 64))
    with pytest.raises(ValueError, match="does not fit w_down"):
        moe_placement(style, "experts.0.down_proj.weight").load(block.w_down, torch.zeros(32, 64))
    with pytest.raises(ValueError, match="tp_size=3 must divide the model's intermediate_size"):
        SparseMoE(config, style, TensorParallel(0, 3))


def test_split_moe_name():
    mixtral, qwen = MOE_STYLES["MixtralForCausalLM"], MOE_STYLES["Qwen3MoeForCausalLM"]
    assert split_moe_name(mixtral, "model.layers.3.block_sparse_moe.experts.1.w2.weight") == (
        "model.layers.3", "experts.1.w2.weight")
    assert split_moe_name(qwen, "model.layers.0.mlp.gate.weight") == ("model.layers.0", "gate.weight")
    assert split_moe_name(qwen, "model.layers.0.self_attn.q_proj.weight") is None
