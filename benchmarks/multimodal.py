"""Questions about images: 32 about one image and 32 about 32 different images, furcate with the radix cache on
and off beside HF transformers' generate on the same weights, in one run; and the encoder's time per image.

`python -m furcate.benchmarks.multimodal`. No vision-language checkpoint can be downloaded here, so the model is
a LLaVA built from the default model: SmolLM2-135M's text weights (plus one embedding row for `<image>`) and a
random CLIP tower (224x224 images, patch 14: 256 tokens per image, 4 layers of width 256) with its projector.
Outputs are compared token for token (float32, greedy). Writes benchmarks/results/multimodal.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import tempfile
import time

import numpy as np
import torch

from .peers_report import cpu_flags

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
QUESTIONS = 32


def build_llava(directory: pathlib.Path) -> pathlib.Path:
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from furcate.runtime.model.weights.default_model import prepare_default_model

    source = prepare_default_model()
    text_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text_config = text_model.config
    text_config.vocab_size = len(tokenizer)
    text_config.tie_word_embeddings = False
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              image_size=224, patch_size=14)
    config = LlavaConfig(text_config=text_config, vision_config=vision, vision_feature_layer=-2,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    llava = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        state = text_model.state_dict()
        for name, param in llava.model.language_model.named_parameters():
            weight = state[f"model.{name}"]
            param[: weight.shape[0]].copy_(weight)
        llava.lm_head.weight[: state["lm_head.weight"].shape[0]].copy_(state["lm_head.weight"])
    llava.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(
        directory)
    return directory


def pictures(count: int):
    from PIL import Image

    return [Image.fromarray((np.random.RandomState(i).rand(240, 320, 3) * 255).astype(np.uint8))
            for i in range(count)]


def prompts() -> list[str]:
    return [f"<image>\nQuestion {i}: what is in the picture, and how many things are there?\nAnswer:"
            for i in range(QUESTIONS)]


def furcate_run(model_dir: str, images: list, args: argparse.Namespace, radix: bool) -> dict:
    from furcate import Engine

    with Engine(model_dir, dtype="float32", quantization="none", torch_num_threads=args.threads,
                disable_radix_cache=not radix, max_total_tokens=QUESTIONS * 400) as engine:
        # As HF's min_new_tokens: EOS masked for every step, so both emit the same number of tokens.
        sampling = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens, "temperature": 0}
        engine.generate(prompts()[0], sampling, image_data=images[0])  # warm-up
        assert engine.flush_cache()
        started = time.perf_counter()
        outputs = engine.generate(prompts(), sampling, image_data=images)
        seconds = time.perf_counter() - started
        stats = engine.get_stats()
    return {"seconds": seconds, "outputs": [o["output_ids"] for o in outputs],
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outputs),
            "prompt_tokens": stats["prompt_tokens_total"]}


def hf_run(model_dir: str, images: list, args: argparse.Namespace) -> dict:
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    torch.set_num_threads(args.threads)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer, processor = AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir)
    image_token, per_image = model.config.image_token_index, 256
    rows = []
    for prompt in prompts():
        ids = []
        for token in tokenizer.encode(prompt):
            ids += [token] * (per_image if token == image_token else 1)
        rows.append(ids)
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pixels = torch.from_numpy(processor(images=images, return_tensors="np")["pixel_values"])
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, pixel_values=pixels, do_sample=False,
                             max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, pad_token_id=0)
    return {"seconds": time.perf_counter() - started, "outputs": out[:, width:].tolist()}


def encoder_seconds(model_dir: str, image, threads: int) -> float:
    from transformers import AutoImageProcessor

    from furcate.runtime.model.vision import load_vision_encoder

    torch.set_num_threads(threads)
    encoder = load_vision_encoder(model_dir, torch.float32, "cpu")
    pixels = torch.from_numpy(AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="np")
                              ["pixel_values"])
    encoder(pixels)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        encoder(pixels)
        times.append(time.perf_counter() - started)
    return min(times)


def run(args: argparse.Namespace) -> dict:
    flags, load_before = cpu_flags(), os.getloadavg()
    scratch = tempfile.mkdtemp(prefix="furcate-llava-")
    model_dir = str(build_llava(pathlib.Path(scratch) / "llava"))
    many = pictures(QUESTIONS)
    workloads = {"same image": [many[0]] * QUESTIONS, "different images": many}
    rows = {}
    for name, images in workloads.items():
        row = {"radix": furcate_run(model_dir, images, args, True),
               "no_radix": furcate_run(model_dir, images, args, False)}
        if not args.skip_hf:
            row["hf"] = hf_run(model_dir, images, args)
        rows[name] = row
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "cpu_flags": flags,
            "load_before": load_before, "load_after": os.getloadavg(), "threads": args.threads,
            "max_new_tokens": args.max_new_tokens, "torch": torch.__version__, "workloads": rows,
            "encoder_seconds_per_image": encoder_seconds(model_dir, many[0], args.threads)}


def markdown(report: dict) -> str:
    tokens = QUESTIONS * report["max_new_tokens"]
    lines = ["# Questions about images (LLaVA from SmolLM2-135M + a random CLIP tower, 256 tokens per image)", "",
             f"{report['date']}; CPU flags {report['cpu_flags'] or 'none of avx512_bf16/amx_tile'}; "
             f"{report['threads']} threads; load before {report['load_before']}, after {report['load_after']}; "
             f"torch {report['torch']}; {QUESTIONS} requests of {report['max_new_tokens']} greedy tokens, float32.",
             "", "| workload | system | s | output tok/s | vs HF | cached prompt tokens | outputs equal HF |",
             "|---|---|---|---|---|---|---|"]
    for name, row in report["workloads"].items():
        hf = row.get("hf")
        for system in ("radix", "no_radix", "hf"):
            if system not in row:
                continue
            result = row[system]
            ratio = f"{hf['seconds'] / result['seconds']:.2f}x" if hf else "-"
            equal = sum(a == b for a, b in zip(result["outputs"], hf["outputs"])) if hf else 0
            same = "-" if not hf or system == "hf" else f"{equal}/{QUESTIONS}"
            lines.append(f"| {name} | {system} | {result['seconds']:.1f} | {tokens / result['seconds']:.1f} | "
                         f"{ratio} | {result.get('cached_tokens', '-')} | {same} |")
    lines += ["", f"Image encoder (CLIP tower + projector): {report['encoder_seconds_per_image'] * 1e3:.1f} ms per "
              "image.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    report = run(parser.parse_args())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "multimodal.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "multimodal.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
