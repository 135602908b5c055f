"""Multi-turn chat with roles: a system prompt, user turns, and assistant turns the model writes.

Roles are rendered with the model's own chat template, so `state.text()` is exactly what
`tokenizer.apply_chat_template` gives for `state.messages()`.

Run: python examples/multi_turn_chat.py
"""

from __future__ import annotations

import textwrap

import furcate as sgl


@sgl.function
def multi_turn_chat(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    with s.user():  # a role as a block: everything added inside is the user's turn
        s += question_1
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32, stop="\n"))
    s += sgl.user(question_2)  # a role as an expression
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=32, stop="\n"))


def main() -> None:
    with sgl.Engine("default", max_total_tokens=8192) as engine:
        sgl.set_default_backend(engine)
        state = multi_turn_chat.run(question_1="What is the capital of France?",
                                    question_2="What river flows through it?", temperature=0)

        print("== the conversation (state.messages()) ==")
        for message in state.messages():
            body = textwrap.fill(message["content"].strip(), width=76, subsequent_indent=" " * 12)
            print(f"{message['role']:>9} : {body}")

        print("\n== the variables ==")
        print("answer_1:", repr(state["answer_1"]))
        print("answer_2:", repr(state["answer_2"]))

        print("\n== the rendered prompt (state.text()) ==")
        print(state.text().rstrip())
        rendered = engine.tokenizer.apply_chat_template(state.messages(), tokenize=False)
        print("same as apply_chat_template(state.messages()):", rendered == state.text())


if __name__ == "__main__":
    main()
