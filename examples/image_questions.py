"""Questions about an image: `sgl.image(...)` inside a role shows the image to a vision-language model, `fork`
asks several questions about it at once (the image is encoded once and its tokens shared in the radix cache),
and `select` picks an answer.

furcate never downloads a model, so this example builds a tiny LLaVA with random weights (the default model's
tokenizer with an `<image>` token, a two-layer CLIP tower, a projector): the answers are gibberish, the
mechanics are real. Point MODEL at a real LLaVA checkpoint directory (LlavaForConditionalGeneration) to get
real answers.

Run: python examples/image_questions.py
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

import furcate as sgl
from furcate.runtime.model.weights.default_model import prepare_default_model

MODEL = None  # a LLaVA checkpoint directory; None builds the tiny random one


def tiny_llava(directory: pathlib.Path) -> pathlib.Path:
    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    config = LlavaConfig(text_config=text, vision_config=vision, vision_feature_layer=-2,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory


@sgl.function
def questions(s, image):
    s += sgl.user(sgl.image(image) + " Describe this picture.")
    s += sgl.assistant(sgl.gen("description", max_tokens=24))
    branches = s.fork(3)
    for branch, question in zip(branches, ("What colour dominates?", "Is it a photo?", "What is in the corner?")):
        branch += sgl.user(question)
        branch += sgl.assistant(sgl.gen("answer", max_tokens=16))
    s["answers"] = [branch["answer"] for branch in branches]
    s += sgl.user("Indoors or outdoors?")
    s += sgl.assistant(sgl.select("where", ["indoors", "outdoors"]))


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        model = MODEL or str(tiny_llava(pathlib.Path(scratch) / "llava"))
        picture = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype(np.uint8))
        with sgl.Engine(model) as engine:
            state = questions.run(image=picture, backend=sgl.LocalBackend(engine))
            print("description:", state["description"])
            for answer in state["answers"]:
                print("answer:", answer)
            print("where:", state["where"])
            print("prompt tokens cached by the questions:", engine.get_stats()["cached_tokens_total"])


if __name__ == "__main__":
    main()
