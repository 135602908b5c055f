"""Programs with roles render each model family's own chat template: the text a program builds is what
`apply_chat_template` gives for its messages (the families' real templates, tests/chat_templates/), on the tiny
llama engine with each template as the backend's."""

from __future__ import annotations

from pathlib import Path

import pytest

import furcate as sgl
from furcate import ProgramError

TEMPLATES = Path(__file__).parent / "chat_templates"
# Families whose templates take a system message (Gemma 3 folds it into the first user turn), and Gemma 2's,
# which refuses one.
WITH_SYSTEM = ["gemma3", "granite3.1", "olmo2", "phi3.5", "phi4-mini", "smollm3", "llama3.1", "qwen2.5"]
ALL = [*WITH_SYSTEM, "gemma2"]
GREEDY = {"temperature": 0, "ignore_eos": True}


@sgl.function
def conversation(s, system: bool):
    if system:
        s += sgl.system("You are terse.")
    s += sgl.user("Is the river made of stone?")
    s += sgl.assistant(sgl.select("answer", choices=["yes", "no"]))
    s += sgl.user("And the hills?")
    s += sgl.assistant(sgl.gen("reply", max_tokens=3, regex="[a-z]{1,8}", **GREEDY))


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


def assert_renders_as_template(state, source: str, tokenizer) -> None:
    """Each assistant turn starts where the template's generation prompt leaves the conversation before it, and
    the whole text is the template's rendering of all messages (less an end-of-conversation EOS, Phi-3's)."""
    messages = state.messages()
    text = state.text()
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True,
                                                   chat_template=source)
            assert text.startswith(prompt + message["content"]), (prompt, text)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=source)
    assert rendered in (text, text + tokenizer.eos_token), (rendered, text)


@pytest.mark.parametrize("family", ALL)
def test_roles_without_a_system_message_render_as_the_template(family, engine, tokenizer):
    state = conversation.run(system=False, backend=sgl.LocalBackend(engine, chat_template=template(family)))
    assert [m["role"] for m in state.messages() if m["role"] != "system"] == ["user", "assistant"] * 2
    assert_renders_as_template(state, template(family), tokenizer)


@pytest.mark.parametrize("family", WITH_SYSTEM)
def test_a_system_message_renders_as_the_template(family, engine, tokenizer):
    state = conversation.run(system=True, backend=sgl.LocalBackend(engine, chat_template=template(family)))
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[0]["content"] == "You are terse."
    assert_renders_as_template(state, template(family), tokenizer)


def test_a_template_that_refuses_a_system_message_says_so(engine):
    with pytest.raises(ProgramError, match="cannot open a conversation with a 'system' message: System role not"):
        conversation.run(system=True, backend=sgl.LocalBackend(engine, chat_template=template("gemma2")))


def test_a_default_system_prompt_the_template_would_rewrite_stays_in_the_first_prefix(engine, tokenizer):
    # SmolLM3's template strips '/think' from any system message, its own default's '</think>' included, so the
    # default is not sent back as a message: the conversation renders exactly without it.
    state = conversation.run(system=False, backend=sgl.LocalBackend(engine, chat_template=template("smollm3")))
    assert [m["role"] for m in state.messages()][0] == "user"
    assert "</think> Solution section" in state.text()
