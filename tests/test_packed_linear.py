"""bfloat16 linears on CPU through oneDNN with prepacked weights (runtime/model/packed_linear.py): the same bits as
F.linear on this machine, and an engine that repacks whenever its weights are written (updates, resumed memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from conftest import NO_GRAMMAR, engines_side_by_side
from furcate.runtime.model.packed_linear import PackedLinear, pack_linears, packs
from rl_trainer import round_weights

pytestmark = pytest.mark.skipif(not packs(torch.bfloat16, "cpu"),
                                reason="this CPU's oneDNN has no native bfloat16, so nothing is packed")
PROMPT = list(range(300, 340))
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("shape", [(64, 32), (960, 576), (576, 1536)])
def test_a_packed_linear_gives_f_linears_bits(rows, shape):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(shape[1], shape[0], bias=rows % 2 == 1, dtype=torch.bfloat16)
    model = torch.nn.Sequential(layer)
    assert pack_linears(model) == 1 and isinstance(model[0], PackedLinear) and model[0] is layer
    x = torch.randn(2, rows, shape[1], dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(2)  # a write the layer was not told of is not seen; a repack sees it
        assert not torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.repack()
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_an_updated_engine_serves_the_new_weights_as_an_engine_loaded_with_them(tiny_model_dirs, tmp_path):
    """Updated weights reach the packed copies (a stale copy would serve the old projections), and released then
    resumed weights serve as before."""
    source = tiny_model_dirs["llama"]
    new = round_weights(source, 3)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.load_state_dict(new)
    model.save_pretrained(tmp_path)
    args = {"dtype": "bfloat16", "max_total_tokens": 2000, "torch_num_threads": 1, **NO_GRAMMAR}
    with engines_side_by_side((str(source), args), (str(tmp_path), {**args, "tokenizer_path": str(source)})) as (
            updated, loaded):
        def greedy(engine):
            out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
            return out["output_ids"], [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]

        before = greedy(updated)
        assert updated.update_weights_from_tensor(list(new.items()))[0]
        assert greedy(updated) == greedy(loaded) != before
        assert updated.release_memory_occupation()[0]
        assert updated.resume_memory_occupation()[0]
        assert greedy(updated) == greedy(loaded)
