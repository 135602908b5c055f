"""Images in programs render through the model's own chat template, as HF renders content parts: LLaVA-1.5's
template (each image as '<image>\\n' before its message's text, text read only from parts, 'ASSISTANT:' as the
generation prompt) and Qwen2-VL's (vision tokens where the image stands, a default system message), on tiny
models carrying those templates. A program's prompt equals `apply_chat_template` of the same conversation (LLaVA's
through LlavaProcessor) and its greedy answer HF's; a furcate server renders the same, over the native and the
OpenAI routes; images a template cannot place are clear errors."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, LlavaProcessor

import furcate as sgl
from conftest import EXACT, assert_pool_free, engines_side_by_side
from furcate import LocalBackend, ProgramError
from furcate.runtime.server.chat_render import TOOLS_PREAMBLE, render_chat
from furcate.runtime.server.openai_protocol import ChatCompletionRequest, parse
from furcate.runtime.server.server_process import ServerProcess
from furcate.runtime.server.tool_calls import request_tools
from tiny_models import PATCH, build_tiny_llava, build_tiny_qwen_vl
from vision_references import LlavaReference, QwenVLReference

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILIES = ["llava", "qwen2_vl"]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
# Qwen2-VL's template, but showing no image in a system message.
NO_SYSTEM_IMAGES = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
                    "{% elif message['role'] != 'system' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
                    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                    "{% endif %}")


def picture(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(40, 48, 3) * 255).astype(np.uint8))


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def image(source: Image.Image) -> dict:
    return {"type": "image", "image": source}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("vision-templates")
    return {"llava": build_tiny_llava(root / "llava", default_model_dir, template("llava1.5")),
            "qwen2_vl": build_tiny_qwen_vl("qwen2_vl", root / "qwen2_vl", default_model_dir, template("qwen2-vl"))}


@pytest.fixture(scope="module")
def engines(model_dirs):
    with engines_side_by_side(*[(str(directory), {**EXACT, "max_total_tokens": 4096, "torch_num_threads": 1})
                                for directory in model_dirs.values()]) as started:
        yield dict(zip(model_dirs, started))
        for engine in started:
            assert_pool_free(engine)


class LlavaProcessorReference:
    """HF end to end: LlavaProcessor renders the conversation with the template, expands each image to its 16
    tokens and processes its pixels; the model generates from that."""

    def __init__(self, model_dir: Path) -> None:
        self.base = LlavaReference(model_dir)
        self.tokenizer = self.base.tokenizer
        self.processor = LlavaProcessor(image_processor=AutoImageProcessor.from_pretrained(model_dir),
                                        tokenizer=self.tokenizer, chat_template=self.tokenizer.chat_template,
                                        patch_size=PATCH, vision_feature_select_strategy="default",
                                        num_additional_image_tokens=1)

    def prompt(self, conversation: list[dict]) -> str:
        return self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

    @torch.inference_mode()
    def answer(self, conversation: list[dict]) -> str:
        inputs = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True, return_tensors="pt")
        out = self.base.model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                       pad_token_id=0)
        return self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class QwenTemplateReference:
    """The tokenizer's `apply_chat_template` (Qwen2VLProcessor needs torchvision), then HF's model on that prompt
    with each image's pad expanded as the processor does."""

    def __init__(self, model_dir: Path) -> None:
        self.base = QwenVLReference(model_dir)
        self.tokenizer = self.base.tokenizer

    def prompt(self, conversation: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

    def answer(self, conversation: list[dict]) -> str:
        images = [part["image"] for m in conversation if isinstance(m["content"], list) for part in m["content"]
                  if part["type"] == "image"]
        return self.tokenizer.decode(self.base.greedy(self.prompt(conversation), images), skip_special_tokens=True)


@pytest.fixture(scope="module")
def references(model_dirs):
    return {"llava": LlavaProcessorReference(model_dirs["llava"]),
            "qwen2_vl": QwenTemplateReference(model_dirs["qwen2_vl"])}


def prompt_before(state, name: str) -> str:
    return state.text()[: state.text().rindex(state[name])]


@sgl.function
def ask(s, picture):
    s += sgl.user(sgl.image(picture) + "What is this?")
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_programs_prompt_is_the_templates_and_its_answer_hfs(family, engines, references):
    shown = picture(1)
    state = ask.run(picture=shown, backend=LocalBackend(engines[family]))
    conversation = [{"role": "user", "content": [image(shown), text("What is this?")]}]
    assert [m for m in state.messages() if m["role"] == "user"] == conversation
    prompt = prompt_before(state, "answer")
    assert prompt == references[family].prompt(conversation)
    if family == "llava":  # the image's newline, the text part's space, the generation prompt without one
        assert prompt == "USER: <image>\nWhat is this? ASSISTANT:"
    assert state["answer"] == references[family].answer(conversation)


@sgl.function
def several_images(s, pictures):
    s += sgl.system(sgl.image(pictures[0]) + "Answer in a word.")
    s += sgl.user(sgl.image(pictures[1]) + sgl.image(pictures[2]) + "Which is brighter?")
    s += sgl.assistant("The first.")
    s += sgl.user(sgl.image(pictures[3]))
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


@pytest.mark.parametrize("family", FAMILIES)
def test_images_in_a_system_message_two_in_one_message_and_one_without_text(family, engines, references):
    shown = [picture(10 + i) for i in range(4)]
    state = several_images.run(pictures=shown, backend=LocalBackend(engines[family]))
    # A template that reads text only from parts (LLaVA's) gets every message as parts.
    answer = [text("The first.")] if family == "llava" else "The first."
    conversation = [{"role": "system", "content": [image(shown[0]), text("Answer in a word.")]},
                    {"role": "user", "content": [image(shown[1]), image(shown[2]), text("Which is brighter?")]},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": [image(shown[3])]}]
    assert state.messages()[:-1] == conversation
    assert prompt_before(state, "answer") == references[family].prompt(conversation)
    assert state["answer"] == references[family].answer(conversation)


@sgl.function
def image_after_text(s, picture):
    s += sgl.user("Look: " + sgl.image(picture))
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


def test_an_image_after_text_where_the_template_puts_images_first_is_refused(engines):
    with pytest.raises(ProgramError, match="before its text, so an image cannot follow text"):
        image_after_text.run(picture=picture(2), backend=LocalBackend(engines["llava"]))["answer"]


def test_an_image_after_text_stands_where_it_is_where_the_template_keeps_order(engines, references):
    shown = picture(2)
    state = image_after_text.run(picture=shown, backend=LocalBackend(engines["qwen2_vl"]))
    conversation = [{"role": "user", "content": [text("Look: "), image(shown)]}]
    assert prompt_before(state, "answer") == references["qwen2_vl"].prompt(conversation)
    assert state["answer"] == references["qwen2_vl"].answer(conversation)


@sgl.function
def system_image(s, picture):
    s += sgl.system(sgl.image(picture) + "Be brief.")
    s += sgl.user("Hello")


def test_a_template_that_shows_no_image_in_a_system_message_says_so(engines):
    backend = LocalBackend(engines["qwen2_vl"], chat_template=NO_SYSTEM_IMAGES)
    with pytest.raises(ProgramError, match="shows no image in a 'system' message"):
        system_image.run(picture=picture(3), backend=backend).sync()


def data_url(shown: Image.Image) -> str:
    encoded = io.BytesIO()
    shown.save(encoded, format="PNG")
    return "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_openai_chat_route_renders_content_parts_as_the_template(family, engines, references):
    """Image parts where they stood and strings as text parts: LLaVA's template would render a plain string as
    nothing."""
    shown = {"type": "image_url", "image_url": {"url": data_url(picture(4))}}
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [shown, {"type": "text", "text": "What is this?"}]},
                         {"role": "assistant", "content": "A cat."},
                         {"role": "user", "content": [{"type": "text", "text": "And "}, shown]}]}
    conversation = [{"role": "system", "content": [text("Be brief.")]},
                    {"role": "user", "content": [{"type": "image"}, text("What is this?")]},
                    {"role": "assistant", "content": [text("A cat.")]},
                    {"role": "user", "content": [text("And "), {"type": "image"}]}]
    rendered = render_chat(engines[family], parse(ChatCompletionRequest, body), [])
    assert rendered == references[family].prompt(conversation)


def test_tools_join_a_system_message_of_parts(engines):
    """LLaVA's template takes no tools: they go into the system message, whose text is a text part there."""
    body = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(6))}},
                                                      {"type": "text", "text": "What time is it?"}]}],
            "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]}
    req = parse(ChatCompletionRequest, body)
    rendered = render_chat(engines["llava"], req, request_tools(req)[0])
    assert rendered.startswith("Be brief.\n\n" + TOOLS_PREAMBLE) and '"get_time"' in rendered
    assert rendered.endswith(" USER: <image>\nWhat time is it? ASSISTANT:")


@pytest.fixture(scope="module")
def llava_server(model_dirs):
    with ServerProcess(str(model_dirs["llava"]), {**EXACT, "max_total_tokens": 2048,
                                                  "torch_num_threads": 1}) as server:
        yield server


def test_a_server_renders_images_as_the_local_program(engines, llava_server, references):
    """RuntimeEndpoint builds the prompt with the server's template, the OpenAI backend sends image_url parts
    the server renders, and an OpenAI client's parts render the same."""
    shown = picture(5)
    local = ask.run(picture=shown, backend=LocalBackend(engines["llava"]))
    remote = ask.run(picture=shown, backend=sgl.RuntimeEndpoint(llava_server.url))
    assert remote.text() == local.text()
    client = openai.OpenAI(base_url=f"{llava_server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    over_openai = ask.run(picture=shown, backend=sgl.OpenAI(model, base_url=f"{llava_server.url}/v1",
                                                             server_extensions=True))
    parts = [{"type": "image_url", "image_url": {"url": data_url(shown)}}, {"type": "text", "text": "What is this?"}]
    reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": parts}])
    expected = references["llava"].answer([{"role": "user", "content": [image(shown), text("What is this?")]}])
    assert local["answer"] == remote["answer"] == over_openai["answer"] == reply.choices[0].message.content == \
        expected
