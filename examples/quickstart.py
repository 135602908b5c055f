"""furcate quickstart: the embedded default model (SmolLM2-135M-Instruct) on the local engine, on CPU.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import time

import furcate


def chat(engine: furcate.Engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                add_generation_prompt=True)


def main() -> None:
    with furcate.Engine("default", max_total_tokens=8192) as engine:
        greedy = {"max_new_tokens": 64, "temperature": 0.0}

        print("== streaming one answer ==")
        printed = 0
        for chunk in engine.generate(chat(engine, "What is the capital of France?"), greedy, stream=True):
            print(chunk["text"][printed:], end="", flush=True)
            printed = len(chunk["text"])
        print()

        print("\n== a batch of questions, continuously batched ==")
        questions = ["Name three primary colors.", "What is 12 times 12?", "Write a haiku about the sea."]
        started = time.perf_counter()
        results = engine.generate([chat(engine, q) for q in questions], greedy)
        for question, result in zip(questions, results):
            meta = result["meta_info"]
            print(f"- {question}\n  {result['text'].strip()!r}  "
                  f"({meta['completion_tokens']} tokens, finish: {meta['finish_reason']['type']})")
        print(f"batch took {time.perf_counter() - started:.1f}s")

        print("\n== seeded sampling with logprobs ==")
        sampled = engine.generate(chat(engine, "Tell me a fun fact."),
                                  {"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.95, "sampling_seed": 1},
                                  return_logprob=True, return_text_in_logprobs=True)
        print(sampled["text"])
        print("first tokens:", [(round(lp, 2), text) for lp, _, text in
                                sampled["meta_info"]["output_token_logprobs"][:5]])


if __name__ == "__main__":
    main()
