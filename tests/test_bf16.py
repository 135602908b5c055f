"""bfloat16: what dtype="auto" picks, and the engine in bfloat16 against HF transformers in bfloat16.

bfloat16 kernels (oneDNN's matmuls, the paged attention kernel, which computes in float32 and rounds once) round
differently from HF's eager path, so bfloat16 is held to a tolerance on logprobs, not to token equality: the
largest difference over a prompt's tokens stays under BF16_LOGPROB_TOLERANCE, or ours is within bfloat16's own
noise of HF float32: no further from it than BF16_NOISE_FACTOR times HF bfloat16's distance. Greedy agreement is
reported (pytest -s).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import ARCHS, NO_GRAMMAR, HFReference, assert_pool_free, engine_starting
from furcate import Engine
from furcate.runtime.model.weights import loader

# Largest |logprob difference| against HF bfloat16, over the chosen tokens of a prompt. bfloat16 keeps 8 bits
# of mantissa, so a logit of magnitude 10 is only known to about 0.04; on an avx512_bf16 machine the measured
# difference was below 1e-4 for all five models and greedy agreement was 1.00 (prefill and decode alike).
BF16_LOGPROB_TOLERANCE = 0.05
# Two bfloat16 computations that round in different places land a comparable distance from float32, not the same
# one. On average over a prompt's tokens ours stays within BF16_NOISE_FACTOR of HF bfloat16's distance; the
# largest single distance is a noisier figure (one improbable token, whose logprob bfloat16 knows least, decides
# it), held to BF16_WORST_FACTOR. Measured on the default model's chat template (8 prompts, 2026-12-07): mean
# distance 0.075 against HF bfloat16's 0.061 (1.23x; the float-widening kernel before: 0.086, 1.41x), largest
# 0.507 against 0.287 (1.77x; before: 0.397, 1.39x), the same template token every time.
BF16_NOISE_FACTOR = 1.5
BF16_WORST_FACTOR = 2.0


@pytest.mark.parametrize("native, config_dtype, expected", [
    (True, "float32", torch.bfloat16),
    (False, "float32", torch.float32),
    (False, "bfloat16", torch.bfloat16),
    (False, "float16", torch.float32),
])
def test_auto_dtype_follows_the_cpu(monkeypatch, native, config_dtype, expected):
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
    config = AutoConfig.for_model("llama", dtype=config_dtype)
    assert loader.resolve_dtype("auto", config) == expected
    assert loader.resolve_dtype("float32", config) == torch.float32


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _engine_prompt_logprobs(engine: Engine, ids: list[int]) -> list[float]:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                          logprob_start_len=1)
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]


def _hf_bf16(model_dir, ids: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """HF bfloat16's logprobs of the prompt's tokens and its greedy continuation."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    reference = _hf_logprobs(model, ids)
    expected = torch.tensor([reference[i - 1, ids[i]].item() for i in range(1, len(ids))])
    with torch.inference_mode():
        prompt = torch.tensor([ids])
        hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
    return expected, hf


def _compare(engine: Engine, hf_bf16: tuple[torch.Tensor, list[int]], ids: list[int],
             new_tokens: int) -> tuple[float, float]:
    """(largest logprob difference over the prompt, greedy agreement share) against HF bfloat16."""
    expected, hf = hf_bf16
    got = torch.tensor(_engine_prompt_logprobs(engine, ids))
    ours = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                                           "ignore_eos": True})["output_ids"]
    same = next((i for i, (a, b) in enumerate(zip(hf, ours)) if a != b), len(hf))
    return float((got - expected).abs().max()), same / len(hf)


def assert_bf16_within_noise(engine: Engine, model_dir, ids: list[int], new_tokens: int,
                             reference: tuple[torch.Tensor, list[int]], label: str) -> None:
    """Within BF16_LOGPROB_TOLERANCE of HF bfloat16's prompt logprobs, or within bfloat16's noise of HF float32's:
    on average within BF16_NOISE_FACTOR of HF bfloat16's distance, and at most BF16_WORST_FACTOR at any token."""
    worst, agreement = _compare(engine, reference, ids, new_tokens)
    float32 = HFReference(model_dir).logprobs(ids)
    exact = torch.tensor([float32[i - 1, ids[i]].item() for i in range(1, len(ids))])
    ours = (torch.tensor(_engine_prompt_logprobs(engine, ids)) - exact).abs()
    hf = (reference[0] - exact).abs()
    print(f"{label}: max |logprob diff| {worst:.4f} (from float32: ours mean {ours.mean():.4f} max {ours.max():.4f}, "
          f"HF bf16 mean {hf.mean():.4f} max {hf.max():.4f}), greedy agreement {agreement:.2f}")
    assert worst < BF16_LOGPROB_TOLERANCE or (ours.mean() <= BF16_NOISE_FACTOR * hf.mean()
                                              and ours.max() <= BF16_WORST_FACTOR * hf.max())


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_in_bf16_stay_within_tolerance_of_hf_bf16(arch, tiny_model_dirs):
    ids = list(range(300, 360))
    with engine_starting(str(tiny_model_dirs[arch]), dtype="bfloat16", max_total_tokens=1000, torch_num_threads=2,
                         **NO_GRAMMAR) as started:
        reference = _hf_bf16(tiny_model_dirs[arch], ids, 16)  # while the engine starts
        engine = started()
        assert engine.info.dtype == "bfloat16"
        assert_bf16_within_noise(engine, tiny_model_dirs[arch], ids, 16, reference, arch)
        assert_pool_free(engine)


def test_default_model_in_bf16_stays_within_tolerance_of_hf_bf16(default_model_dir, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Explain photosynthesis to a child."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    with engine_starting("default", dtype="bfloat16", quantization="none", max_total_tokens=2000,
                         torch_num_threads=2, **NO_GRAMMAR) as started:
        reference = _hf_bf16(default_model_dir, ids, 24)  # while the engine starts
        engine = started()
        assert_bf16_within_noise(engine, default_model_dir, ids, 24, reference, "default model")
        assert_pool_free(engine)
