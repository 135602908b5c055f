"""HF transformers references of the tiny vision-language models (float32): greedy tokens from a prompt whose
image placeholders are expanded as the models' processors expand them."""

from __future__ import annotations

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, LlavaForConditionalGeneration

from tiny_models import QWEN_MERGE

TOKENS_PER_IMAGE = 16  # the tiny LLaVA's: 32x32 pixels in 8x8 patches


class LlavaReference:
    def __init__(self, model_dir) -> None:
        self.model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_token = self.model.config.image_token_index

    def expanded(self, prompt: str) -> list[int]:
        ids = []
        for token in self.tokenizer.encode(prompt):
            ids += [token] * (TOKENS_PER_IMAGE if token == self.image_token else 1)
        return ids

    @torch.inference_mode()
    def greedy(self, prompt: str, images: list[Image.Image], max_new_tokens: int = 8) -> list[int]:
        ids = torch.tensor([self.expanded(prompt)])
        pixels = torch.from_numpy(self.processor(images=images, return_tensors="np")["pixel_values"])
        out = self.model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()


class QwenVLReference:
    def __init__(self, model_dir) -> None:
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_token = self.model.config.image_token_id

    def inputs(self, prompt: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """HF's model inputs: each `<|image_pad|>` expanded to its image's tokens, as Qwen2VLProcessor does."""
        pixels = dict(self.processor(images=images, return_tensors="pt")) if images else {}
        counts = iter((pixels["image_grid_thw"].prod(-1) // QWEN_MERGE**2).tolist() if images else [])
        ids: list[int] = []
        for token in self.tokenizer.encode(prompt):
            ids += [token] * (next(counts) if token == self.image_token else 1)
        input_ids = torch.tensor([ids])
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "mm_token_type_ids": (input_ids == self.image_token).int(), **pixels}

    @torch.inference_mode()
    def greedy(self, prompt: str, images: list[Image.Image], max_new_tokens: int = 8) -> list[int]:
        inputs = self.inputs(prompt, images)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
