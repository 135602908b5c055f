"""The real default model (SmolLM2-135M-Instruct from its GGUF): right tokenizer, HF-equal greedy, a real answer."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from conftest import assert_pool_free


def test_tokenizer_splits_digits_one_by_one(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("12345 and 2024"))
    assert pieces[:5] == ["1", "2", "3", "4", "5"]
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_capital_of_france_is_paris(default_engine, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    out = default_engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert_pool_free(default_engine)


def test_greedy_equals_hf_on_the_default_model(default_engine, default_model_dir, tokenizer):
    prompts = ["The three primary colors are", "def fibonacci(n):\n    ", "In 1969, the first humans"]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                                 do_sample=False, pad_token_id=2)
            expected.append(out[0, ids.shape[1]:].tolist())
    got = default_engine.generate(prompts, {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert [g["output_ids"] for g in got] == expected
    assert_pool_free(default_engine)
