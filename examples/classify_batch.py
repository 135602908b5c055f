"""Classification with select: score each label as a continuation and keep the likeliest, over a batch.

`sgl.select` appends exactly one of its choices; its meta info holds the score of every choice (the mean
logprob of the choice's tokens, "normalized_prompt_logprobs").

Run: python examples/classify_batch.py
"""

from __future__ import annotations

import furcate as sgl

REVIEWS = [
    ("An absolute delight from start to finish.", "positive"),
    ("I want my two hours back.", "negative"),
    ("The food was cold and the waiter was rude.", "negative"),
    ("Best purchase I have made all year!", "positive"),
    ("It broke after one day. Terrible quality.", "negative"),
    ("The staff were friendly and the room was spotless.", "positive"),
    ("Boring plot, wooden acting, awful ending.", "negative"),
    ("I loved it and would happily go again.", "positive"),
]


@sgl.function
def classify(s, review):
    s += "Classify the sentiment of each review as positive or negative.\n\n"
    s += "Review: What a wonderful, heartwarming film.\nSentiment: positive\n\n"
    s += "Review: The battery died within an hour.\nSentiment: negative\n\n"
    s += f"Review: {review}\nSentiment: "
    s += sgl.select("label", choices=["positive", "negative"])


def main() -> None:
    with sgl.Engine("default", max_total_tokens=8192) as engine:
        sgl.set_default_backend(engine)
        states = classify.run_batch([{"review": review} for review, _ in REVIEWS], progress_bar=True)

        print("== sentiment of 8 reviews ==")
        print(f"{'review':<52} {'label':<9} {'expected':<9} logprob(pos, neg)")
        correct = 0
        for (review, expected), state in zip(REVIEWS, states):
            label = state["label"]
            scores = state.get_meta_info("label")["normalized_prompt_logprobs"]
            correct += label == expected
            mark = "" if label == expected else "  <- wrong"
            print(f"{review:<52} {label:<9} {expected:<9} ({scores[0]:6.2f}, {scores[1]:6.2f}){mark}")
        print(f"\n{correct}/{len(REVIEWS)} match the expected label")


if __name__ == "__main__":
    main()
