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
from furcate.runtime.model.moe import MOE_STYLES, SparseMoE, moe_placement, split_moe_name

torch.set_num_threads(1)

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
