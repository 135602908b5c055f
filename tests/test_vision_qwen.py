"""Qwen2-VL and Qwen2.5-VL greedy-equal to HF transformers (float32): one image, two of different sizes, image then
text then image, a batch showing different images, chunks of 16 through an image, radix on and off, a tiny KV
pool that retracts requests (they recompute prompt and outputs at their M-RoPE positions); the radix cache sharing
a prefix only with the same image; text-only prompts; the prompt's positions equal to HF's get_rope_index."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import furcate as sgl
from conftest import EXACT, assert_pool_free, engines_side_by_side
from furcate import LocalBackend
from furcate.runtime.multimodal.mrope import prompt_positions
from furcate.runtime.wire.messages import ImageSpan
from tiny_models import QWEN_MERGE, build_tiny_qwen_vl
from vision_references import QwenVLReference

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SIZES = [(40, 48), (64, 33), (30, 62)]  # (height, width): 3 x 3, 4 x 2 and 2 x 4 tokens
PROMPTS = [  # (prompt, image sizes)
    (f"Describe {IMAGE} in a few words:", [SIZES[0]]),
    (f"Compare {IMAGE} with {IMAGE}. The second one", [SIZES[1], SIZES[2]]),
    (f"{IMAGE} came first, then some text, and then {IMAGE} closes it", [SIZES[2], SIZES[0]]),
]
# A pool of 100 tokens: a batch of three prompts of 20-30 tokens cannot all decode 16 tokens, so some retract.
TINY_POOL = {"max_total_tokens": 100, "init_new_token_ratio": 0.1, "min_new_token_ratio": 0.05}


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def model_dir(request, tmp_path_factory, default_model_dir):
    return build_tiny_qwen_vl(request.param, tmp_path_factory.mktemp(request.param) / "model", default_model_dir)


@pytest.fixture(scope="module")
def engines(model_dir):
    """Radix cache on; and radix off with prefill in chunks of 16 (which cut through images) on a tiny pool."""
    with engines_side_by_side(
            (str(model_dir), {**EXACT, "max_total_tokens": 4096, "torch_num_threads": 1}),
            (str(model_dir), {**EXACT, **TINY_POOL, "torch_num_threads": 1, "disable_radix_cache": True,
                              "chunked_prefill_size": 16})) as started:
        yield started
        for engine in started:
            assert_pool_free(engine)


@pytest.fixture(scope="module")
def reference(model_dir):
    return QwenVLReference(model_dir)


def shown(index: int) -> list[Image.Image]:
    return [picture(10 * index + j, size) for j, size in enumerate(PROMPTS[index][1])]


def test_the_prompt_positions_are_hf_get_rope_index(reference):
    prompt, _ = PROMPTS[2]
    inputs = reference.inputs(prompt, shown(2))
    expected, delta = reference.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                           image_grid_thw=inputs["image_grid_thw"])
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == reference.image_token and ids[i - 1] != t]
    spans = [ImageSpan(str(i), start, int(grid.prod()) // QWEN_MERGE**2, 0, reference.image_token, None,
                       tuple(grid.tolist()), QWEN_MERGE) for i, (start, grid) in
             enumerate(zip(starts, inputs["image_grid_thw"]))]
    ours = prompt_positions(len(ids), spans)
    assert torch.equal(ours.prompt, expected[:, 0]) and ours.delta == int(delta) and ours.delta < 0


def test_greedy_equals_hf_for_a_batch_of_prompts_showing_different_images(engines, reference):
    images = [shown(i) for i in range(len(PROMPTS))]
    expected = [reference.greedy(prompt, pictures) for (prompt, _), pictures in zip(PROMPTS, images)]
    lengths = [reference.inputs(prompt, pictures)["input_ids"].shape[1] for (prompt, _), pictures in
               zip(PROMPTS, images)]
    for engine in engines:
        outputs = engine.generate([p for p, _ in PROMPTS], GREEDY, image_data=images)
        assert [o["output_ids"] for o in outputs] == expected
        assert [o["meta_info"]["prompt_tokens"] for o in outputs] == lengths
    for i, (prompt, _) in enumerate(PROMPTS):  # alone: one image, two of different sizes, image-text-image
        assert engines[0].generate(prompt, GREEDY, image_data=images[i])["output_ids"] == expected[i]


def test_compiled_decode_after_an_image_keeps_hf_tokens(model_dir, reference):
    """Compiled decode is the CPU default: a request that showed an image decodes through the graphs too (its
    tokens after the image sit at one-axis positions shifted by the image's delta), as does a text-only one."""
    from furcate import Engine

    prompt, _ = PROMPTS[2]  # image, text, image
    expected = reference.greedy(prompt, shown(2))
    text = "a quiet harbour at dawn"
    with Engine(str(model_dir), **EXACT, max_total_tokens=4096, torch_num_threads=2, enable_torch_compile=True,
                torch_compile_max_bs=1) as engine:
        assert engine.generate(prompt, GREEDY, image_data=shown(2))["output_ids"] == expected
        assert engine.get_stats()["compiled_forward_calls"] == len(expected) - 1
        out = engine.generate(text, GREEDY)["output_ids"]
        assert engine.get_stats()["compiled_forward_calls"] == len(expected) + len(out) - 2
    assert out == reference.greedy(text, [])


def test_chunked_prefill_of_16_cuts_through_an_image(engines, reference):
    prompt = f"A preamble before the image, long enough to end a chunk inside it: {IMAGE} so what?"
    image = picture(5, (64, 64))  # 16 tokens
    ids = reference.inputs(prompt, [image])["input_ids"][0].tolist()
    before_image = ids.index(reference.image_token)
    assert before_image % 16 != 0 and before_image + 16 > 16 * (before_image // 16 + 1)
    assert engines[1].generate(prompt, GREEDY, image_data=image)["output_ids"] == reference.greedy(prompt, [image])


def test_the_radix_cache_shares_a_prefix_only_with_the_same_image(engines, reference):
    engine = engines[0]
    assert engine.flush_cache()
    prompt = f"Look: {IMAGE} and tell me"
    one, other = picture(1, SIZES[0]), picture(2, SIZES[0])  # the same size, other pixels
    text_before = reference.inputs(prompt, [one])["input_ids"][0].tolist().index(reference.image_token)
    first = engine.generate(prompt, GREEDY, image_data=one)
    again = engine.generate(prompt, GREEDY, image_data=one)
    assert again["output_ids"] == first["output_ids"] == reference.greedy(prompt, [one])
    assert again["meta_info"]["cached_tokens"] >= text_before + 9
    different = engine.generate(prompt, GREEDY, image_data=other)
    assert different["meta_info"]["cached_tokens"] == text_before
    assert different["output_ids"] == reference.greedy(prompt, [other])


def test_retracted_requests_recompute_at_their_positions(engines, reference):
    engine = engines[1]
    before = engine.get_stats()["num_retractions"]
    params = {**GREEDY, "max_new_tokens": 16}
    images = [shown(i) for i in range(len(PROMPTS))]
    outputs = engine.generate([p for p, _ in PROMPTS], params, image_data=images)
    assert engine.get_stats()["num_retractions"] > before, "the tiny pool was meant to force retraction"
    assert [o["output_ids"] for o in outputs] == [reference.greedy(p, pictures, 16) for (p, _), pictures in
                                                  zip(PROMPTS, images)]


def test_a_text_only_prompt_runs_at_plain_positions(engines, reference):
    prompt = "No image here, only words about"
    assert engines[0].generate(prompt, GREEDY)["output_ids"] == reference.greedy(prompt, [])


@sgl.function
def describe(s, image):
    s += sgl.user(sgl.image(image) + " What is it?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0, ignore_eos=True))


def test_a_program_wraps_the_image_in_vision_tokens(engines, reference):
    image = picture(3, SIZES[1])
    state = describe.run(image=image, backend=LocalBackend(engines[0]))
    assert IMAGE in state.text()
    prompt = state.text()[: state.text().index(state["answer"])]
    expected = reference.tokenizer.decode(reference.greedy(prompt, [image], 6), skip_special_tokens=True)
    assert state["answer"] == expected
