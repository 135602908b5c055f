"""Vision-language models: LLaVA greedy-equal to HF transformers (float32) with one and two images, images
between text, a batch of requests showing different images, chunked prefill cutting through an image, radix on
and off; the radix cache sharing a prefix only with the same image; bad images refused for their request alone."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import openai
import pytest
import requests
import torch
from PIL import Image

import furcate as sgl
from conftest import EXACT, assert_pool_free, engines_side_by_side
from furcate import LocalBackend
from furcate.runtime.server.server_process import ServerProcess
from tiny_models import build_tiny_llava
from vision_references import TOKENS_PER_IMAGE, LlavaReference

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPTS = [  # (prompt, number of images)
    ("Describe <image> in a few words:", 1),
    ("Compare <image> with <image>. The second one", 2),
    ("<image> came first, then some text, and then <image> closes it", 2),
]


def picture(seed: int, size: tuple[int, int] = (40, 48)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, default_model_dir):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "llava", default_model_dir)


@pytest.fixture(scope="module")
def engines(llava_dir):
    """Radix cache on; radix off with prefill in chunks of 16, which cut through images; n-gram speculation."""
    with engines_side_by_side(
            (str(llava_dir), {**EXACT, "max_total_tokens": 4096, "torch_num_threads": 1}),
            (str(llava_dir), {**EXACT, "max_total_tokens": 4096, "torch_num_threads": 1,
                              "disable_radix_cache": True, "chunked_prefill_size": 16}),
            (str(llava_dir), {**EXACT, "max_total_tokens": 4096, "torch_num_threads": 1,
                              "speculative_algorithm": "NGRAM"})) as started:
        yield started
        for engine in started:
            assert_pool_free(engine)


@pytest.fixture(scope="module")
def reference(llava_dir):
    return LlavaReference(llava_dir)


def test_greedy_equals_hf_for_a_batch_of_prompts_showing_different_images(engines, reference):
    images = [[picture(10 * i + j) for j in range(count)] for i, (_, count) in enumerate(PROMPTS)]
    expected = [reference.greedy(prompt, shown) for (prompt, _), shown in zip(PROMPTS, images)]
    for engine in engines[:2]:
        outputs = engine.generate([p for p, _ in PROMPTS], GREEDY, image_data=images)
        assert [o["output_ids"] for o in outputs] == expected
        assert [o["meta_info"]["prompt_tokens"] for o in outputs] == [len(reference.expanded(p)) for p, _ in PROMPTS]


def test_ngram_drafts_stop_before_an_images_pads(engines, reference):
    """Prompt lookup would draft an image's pads: the prompt A B <image> C A, and a first token forced to B, make
    the bigram A B, last seen just before the image, the suffix to draft from."""
    a, b, c = 300, 301, 302
    ids = [a, b, reference.image_token, c, a]
    sampling = {**GREEDY, "logit_bias": {str(b): 100.0}}
    out = engines[2].generate(input_ids=ids, sampling_params=sampling, image_data=picture(9))
    expanded = [a, b] + [reference.image_token] * TOKENS_PER_IMAGE + [c, a]
    pixels = torch.from_numpy(reference.processor(images=[picture(9)], return_tensors="np")["pixel_values"])
    with torch.inference_mode():
        hf = reference.model.generate(input_ids=torch.tensor([expanded]), pixel_values=pixels, max_new_tokens=8,
                                      min_new_tokens=8, do_sample=False, pad_token_id=0,
                                      sequence_bias={(b,): 100.0})
    assert out["output_ids"] == hf[0, len(expanded):].tolist()


def test_the_same_image_in_a_batch_is_encoded_once(engines, reference):
    engine = engines[1]  # radix off: every request computes its whole prompt
    # An image no other test shows: the encoder cache outlives tests.
    before = engine.get_stats()["images_encoded"]
    prompts = [f"Question {i} about <image>:" for i in range(4)]
    outputs = engine.generate(prompts, GREEDY, image_data=[picture(77)] * 4)
    assert engine.get_stats()["images_encoded"] - before == 1
    assert [o["output_ids"] for o in outputs] == [reference.greedy(p, [picture(77)]) for p in prompts]


def test_chunked_prefill_cuts_through_an_image(engines, reference):
    prompt = "A long preamble before the image, long enough to end a chunk inside it: <image> so what?"
    before_image = reference.expanded(prompt).index(reference.image_token)
    assert before_image % 16 != 0 and before_image + TOKENS_PER_IMAGE > 16 * (before_image // 16 + 1)
    out = engines[1].generate(prompt, GREEDY, image_data=picture(5))
    assert out["output_ids"] == reference.greedy(prompt, [picture(5)])


def test_the_radix_cache_shares_a_prefix_only_with_the_same_image(engines, reference):
    engine = engines[0]
    assert engine.flush_cache()
    prompt = "Look: <image> and tell me"
    text_before = reference.expanded(prompt).index(reference.image_token)
    first = engine.generate(prompt, GREEDY, image_data=picture(1))
    again = engine.generate(prompt, GREEDY, image_data=picture(1))
    assert again["output_ids"] == first["output_ids"] == reference.greedy(prompt, [picture(1)])
    assert again["meta_info"]["cached_tokens"] >= text_before + TOKENS_PER_IMAGE
    other = engine.generate(prompt, GREEDY, image_data=picture(2))  # the same size, other pixels
    assert other["meta_info"]["cached_tokens"] == text_before
    assert other["output_ids"] == reference.greedy(prompt, [picture(2)])
    encoded = io.BytesIO()
    picture(1).save(encoded, format="PNG")
    as_png = engine.generate(prompt, GREEDY, image_data=encoded.getvalue())  # same pixels, other encoding
    assert as_png["meta_info"]["cached_tokens"] >= text_before + TOKENS_PER_IMAGE


def test_input_logprobs_report_the_image_token_at_image_positions(engines, reference):
    prompt = "Describe <image> now"
    out = engines[0].generate(prompt, {**GREEDY, "max_new_tokens": 1}, image_data=picture(3),
                              return_logprob=True, logprob_start_len=0)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [token for _, token, _ in entries] == reference.expanded(prompt)
    with torch.inference_mode():
        ids = torch.tensor([reference.expanded(prompt)])
        pixels = torch.from_numpy(reference.processor(images=[picture(3)], return_tensors="np")["pixel_values"])
        logits = reference.model(input_ids=ids, pixel_values=pixels).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    got = torch.tensor([lp for lp, _, _ in entries[1:]])
    assert torch.allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize("bad, why", [
    (b"\x89PNG\r\n\x1a\n not really", "image"),
    ("not base64 and not a path", "base64"),
    ({"url": "x"}, "dict"),
    ([picture(1), picture(2)], "placeholder"),
    ([picture(1)] * 17, "images"),
])
def test_a_bad_image_fails_its_request_alone(engines, bad, why):
    engine = engines[0]
    with pytest.raises(ValueError, match=why):
        engine.generate("One image: <image>.", GREEDY, image_data=bad)
    assert len(engine.generate("One image: <image>.", GREEDY, image_data=picture(4))["output_ids"]) == 8


def test_an_image_on_a_text_only_model_is_refused(engine):
    with pytest.raises(ValueError, match="vision-language"):
        engine.generate("Hello <image>", GREEDY, image_data=picture(1))


def data_url(image: Image.Image) -> str:
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    return "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()


@pytest.fixture(scope="module")
def vision_server(llava_dir):
    with ServerProcess(str(llava_dir), {**EXACT, "max_total_tokens": 2048, "torch_num_threads": 1}) as server:
        yield server


def test_native_generate_and_openai_chat_take_images(vision_server, reference, tokenizer):
    url = vision_server.url
    prompt = "Describe <image> in words:"
    body = {"text": prompt, "sampling_params": GREEDY, "image_data": data_url(picture(6))}
    assert requests.post(f"{url}/generate", json=body, timeout=60).json()["output_ids"] == \
        reference.greedy(prompt, [picture(6)])
    plain = {**body, "image_data": data_url(picture(6)).split(",", 1)[1]}  # bare base64
    assert requests.post(f"{url}/generate", json=plain, timeout=60).json()["output_ids"] == \
        reference.greedy(prompt, [picture(6)])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    parts = [{"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": data_url(picture(7))}},
             {"type": "text", "text": "?"}]
    reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": parts}],
                                           extra_body={"ignore_eos": True})
    rendered = reference.tokenizer.apply_chat_template([{"role": "user", "content": "What is in <image>?"}],
                                                       tokenize=False, add_generation_prompt=True)
    expected = reference.greedy(rendered, [picture(7)])
    assert reply.choices[0].message.content == reference.tokenizer.decode(expected, skip_special_tokens=True)


def test_tool_calls_about_an_image(vision_server):
    """A constrained answer is several requests; each sends the prompt's images again, since its ids hold their
    placeholders."""
    client = openai.OpenAI(base_url=f"{vision_server.url}/v1", api_key="unused", max_retries=0)
    parts = [{"type": "text", "text": "Which color is "},
             {"type": "image_url", "image_url": {"url": data_url(picture(8))}}]
    tools = [{"type": "function", "function": {"name": "report", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}}]
    reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=40, temperature=0,
                                           messages=[{"role": "user", "content": parts}], tools=tools,
                                           tool_choice="required", parallel_tool_calls=False)
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "report"
    assert json.loads(call.function.arguments)["color"] in ("red", "blue")


@pytest.mark.parametrize("path, body, why", [
    ("/generate", {"text": "<image>", "image_data": "/etc/hostname"}, "allow-local-images"),
    ("/generate", {"text": "<image>", "image_data": "data:image/png;base64,%%%"}, "base64"),
    ("/generate", {"text": "<image>", "image_data": {"a": 1}}, "string"),
    ("/generate", {"text": "<image>", "image_data": "http://127.0.0.1:9/x.png"}, "allow_remote_images"),
    ("/v1/completions", {"prompt": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "prompt"),
])
def test_bad_images_over_http_are_400s(vision_server, path, body, why):
    reply = requests.post(vision_server.url + path, json=body, timeout=60)
    assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text
    assert requests.get(vision_server.url + "/health", timeout=10).status_code == 200


def test_a_text_only_server_refuses_image_parts(tiny_server):
    model = requests.get(tiny_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture(1))}}]}]}
    reply = requests.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "vision-language" in reply.json()["error"]["message"], reply.text
    reply = requests.post(tiny_server.url + "/generate", json={"text": "x <image>", "image_data": data_url(picture(1))},
                          timeout=60)
    assert reply.status_code == 400 and "vision-language" in reply.json()["error"]["message"], reply.text


@sgl.function
def ask_about(s, image, question):
    s += sgl.user(sgl.image(image) + " " + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0, ignore_eos=True))
    branches = s.fork(2)
    for branch, follow_up in zip(branches, (" Really?", " Why?")):
        branch += sgl.user(follow_up)
        branch += sgl.assistant(sgl.gen("more", max_tokens=4, temperature=0, ignore_eos=True))
    s["followed"] = [branch["more"] for branch in branches]
    s += " It looks " + sgl.select("color", ["red", "blue", "green and grey"])


def choice_by_hf(reference: LlavaReference, prompt: str, images: list, choices: list[str]) -> str:
    """token_length_normalized, as select's default, from HF's logprobs."""
    pixels = torch.from_numpy(reference.processor(images=images, return_tensors="np")["pixel_values"])
    prompt_ids = reference.expanded(prompt)
    scores = []
    for choice in choices:
        ids = reference.expanded(prompt + choice)
        start = next(i for i, (a, b) in enumerate(zip(prompt_ids + [-1], ids)) if a != b)
        with torch.inference_mode():
            logits = reference.model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        rows = torch.arange(start - 1, len(ids) - 1)
        logprobs = torch.log_softmax(logits.float(), -1)[rows, torch.tensor(ids[start:])]
        scores.append(float(logprobs.mean()))
    return choices[max(range(len(choices)), key=scores.__getitem__)]


def test_a_program_asks_about_an_image_forks_after_it_and_selects(engines, reference, vision_server):
    image = picture(8)
    local = ask_about.run(image=image, question="What is it?", backend=LocalBackend(engines[0]))
    prompt = local.text()[: local.text().index(local["answer"])]
    expected = reference.tokenizer.decode(reference.greedy(prompt, [image], 6), skip_special_tokens=True)
    assert local["answer"] == expected
    before_select = local.text()[: local.text().rindex(local["color"])]
    assert local["color"] == choice_by_hf(reference, before_select, [image], ["red", "blue", "green and grey"])
    remote = ask_about.run(image=image, question="What is it?", backend=sgl.RuntimeEndpoint(vision_server.url))
    assert (remote["answer"], remote["followed"], remote["color"]) == \
        (local["answer"], local["followed"], local["color"])


@sgl.function
def chat_about(s, image):
    s += sgl.user(sgl.image(image) + " What is it?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))
    s += sgl.user("Red or blue?")
    s += sgl.assistant(sgl.select("color", ["red", "blue"]))


def test_the_openai_backend_sends_images_as_image_url_parts(engines, vision_server):
    image = picture(11)
    local = chat_about.run(image=image, backend=LocalBackend(engines[0]))
    model = requests.get(vision_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    remote = chat_about.run(image=image, backend=sgl.OpenAI(model, base_url=vision_server.url + "/v1",
                                                             server_extensions=True))
    assert (remote["answer"], remote["color"]) == (local["answer"], local["color"])

    @sgl.function
    def outside_roles(s, image):
        s += sgl.image(image) + " plain text"
        s += sgl.gen("x", max_tokens=2)

    with pytest.raises(sgl.ProgramError, match="inside a role"):
        outside_roles.run(image=image, backend=sgl.OpenAI(model, base_url=vision_server.url + "/v1"))["x"]


def test_images_count_against_the_context_length(engines, reference):
    """The text and its two placeholders fit the 1024-token context; with each image's 16 tokens it does not."""
    words = 1024 - 10
    prompt = "<image><image>" + " hello" * words
    assert len(reference.tokenizer.encode(prompt)) < 1023 < len(reference.expanded(prompt))
    with pytest.raises(ValueError, match="prompt has"):
        engines[0].generate(prompt, GREEDY, image_data=[picture(1), picture(2)])
