"""How far bfloat16 and quantized weights move the default model from its float32 self.

The float32 engine (quantization none) decodes each prompt greedily; every other configuration is scored on
those same token sequences: greedy agreement (the share of output positions before its own greedy decode
first differs) and the mean absolute difference of the logprob it gives each reference token (teacher forced,
so one early divergence does not count twice).

    python -m benchmarks.precision_quality [--prompts 16] [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
from dataclasses import asdict, dataclass

from furcate import Engine

PROMPTS = ("Write a short poem about the sea.", "What is the capital of France?", "List three uses of copper.",
           "Explain photosynthesis to a child.", "Give me a recipe for pancakes.", "Why is the sky blue?",
           "Describe a walk in a forest.", "What does a compiler do?", "Name the planets of the solar system.",
           "Tell me a joke about cats.", "How do airplanes fly?", "Summarize the plot of Romeo and Juliet.",
           "What is 17 times 23?", "Write a haiku about winter.", "What are prime numbers?",
           "Translate 'good morning' into Spanish.")
CONFIGS = {
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "quantized (GGUF Q4_1 + Q8_0 head)": {"dtype": "bfloat16", "quantization": "gguf"},
}
RESULTS = pathlib.Path(__file__).parent / "results"


@dataclass
class Quality:
    greedy_agreement: float  # share of reference output positions matched before the first difference
    identical_outputs: int  # prompts whose whole greedy output equals the reference
    mean_abs_logprob_diff: float  # over reference output tokens, teacher forced
    max_abs_logprob_diff: float


def chat_ids(engine: Engine, prompt: str) -> list[int]:
    tokenizer = engine.tokenizer
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def greedy(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return [out["output_ids"] for out in engine.generate(input_ids=prompts, sampling_params=params)]


def reference_logprobs(engine: Engine, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """The logprob the engine gives each reference output token after the prompt and the tokens before it."""
    scored = []
    for prompt, output in zip(prompts, outputs):
        out = engine.generate(input_ids=prompt + output, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=len(prompt))
        scored.append([logprob for logprob, _, _ in out["meta_info"]["input_token_logprobs"]])
    return scored


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> tuple[float, int]:
    matched = 0
    for ref, cand in zip(reference, candidate):
        same = next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b), len(ref))
        matched += same
    identical = sum(ref == cand for ref, cand in zip(reference, candidate))
    return matched / sum(len(r) for r in reference), identical


def measure(engine: Engine, prompts: list[list[int]], reference: list[list[int]],
            reference_scores: list[list[float]]) -> Quality:
    share, identical = agreement(reference, greedy(engine, prompts, len(reference[0])))
    diffs = [abs(a - b) for ref, cand in zip(reference_scores, reference_logprobs(engine, prompts, reference))
             for a, b in zip(ref, cand)]
    return Quality(share, identical, sum(diffs) / len(diffs), max(diffs))


def run(num_prompts: int, tokens: int, threads: int) -> dict:
    common = {"max_total_tokens": 8192, "torch_num_threads": threads}
    with Engine("default", dtype="float32", quantization="none", **common) as engine:
        prompts = [chat_ids(engine, p) for p in PROMPTS[:num_prompts]]
        reference = greedy(engine, prompts, tokens)
        reference_scores = reference_logprobs(engine, prompts, reference)
    results = {}
    for name, args in CONFIGS.items():
        with Engine("default", **args, **common) as engine:
            results[name] = asdict(measure(engine, prompts, reference, reference_scores))
            results[name]["engine_args"] = args
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "reference": "float32, every weight dequantized from the GGUF", "prompts": num_prompts,
            "output_tokens": tokens, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    report = run(args.prompts, args.tokens, args.threads)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "precision_quality.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["results"], indent=2))


if __name__ == "__main__":
    main()
