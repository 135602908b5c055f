"""Reasoning models' think blocks: `<think>` ... `</think>` before the answer, told apart from it.

Two parsers, as SGLang and vLLM name them: `deepseek-r1` (the output is reasoning until `</think>`, whether or not
it opened the block: DeepSeek-R1's template opens it in the prompt) and `qwen3` (reasoning only when the block is
opened, by the output or at the prompt's end; Qwen3's template closes it in the prompt when thinking is off).
Torch-free: the server and the interpreter (separate_reasoning) both use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    forced: bool  # the output starts in reasoning even when nothing opened the block
    start: str = START
    end: str = END

    def opened_by(self, prompt: str) -> bool | None:
        """Whether the prompt leaves the model inside a think block (True), after a closed one (False), or
        neither (None: the model's first words decide)."""
        opened, closed = prompt.rfind(self.start), prompt.rfind(self.end)
        if opened > closed and not prompt[opened + len(self.start):].strip():
            return True
        if closed > opened and not prompt[closed + len(self.end):].strip():
            return False
        return None

    def in_reasoning(self, prompt_state: bool | None) -> bool | None:
        """Where output begins: True inside the block, False in the answer, None undecided (qwen3: `<think>`
        first decides)."""
        if prompt_state is None and self.forced:
            return True
        return prompt_state


FORMATS = {"deepseek-r1": ReasoningFormat("deepseek-r1", forced=True), "qwen3": ReasoningFormat("qwen3",
                                                                                                forced=False)}


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def detect(chat_template: str | None) -> str | None:
    """qwen3 for templates that switch thinking with enable_thinking, deepseek-r1 for others that write think
    blocks; None for templates without them."""
    if not chat_template or END not in chat_template:
        return None
    return "qwen3" if "enable_thinking" in chat_template else "deepseek-r1"


def split(fmt: ReasoningFormat, text: str, begins: bool | None) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output that began as `begins` says (see in_reasoning)."""
    reasoning, content, _ = _split(fmt, text, begins, final=True)
    return reasoning, content


def _split(fmt: ReasoningFormat, text: str, begins: bool | None, final: bool) -> tuple[str | None, str, bool]:
    """(reasoning, content, closed); unless `final`, text that may still turn into a tag is held back."""
    if begins is False:
        return None, text, True
    body = text.lstrip()
    if body.startswith(fmt.start):
        body = body[len(fmt.start):]
    elif not final and fmt.start.startswith(body):
        return "", "", False  # `<thi`: maybe the block's start tag, which a model inside its block may write too
    elif begins is None:
        return None, text, True
    if fmt.end not in body:
        return body if final else body[:len(body) - partial_tag(body, fmt.end)], "", False
    reasoning, content = body.split(fmt.end, 1)
    return reasoning, content.lstrip(), True


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what a stream holds back: it may become `tag`)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


@dataclass
class ReasoningStream:
    """Splits a growing output into reasoning and content deltas, holding back what may still become a tag."""

    fmt: ReasoningFormat
    begins: bool | None
    sent_reasoning: int = 0
    sent_content: int = 0
    reasoning: str | None = field(default=None)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) now that the output is `text`."""
        reasoning, content, _ = _split(self.fmt, text, self.begins, final)
        if reasoning is not None:
            self.reasoning = reasoning
        new_reasoning = (reasoning or "")[self.sent_reasoning:]
        new_content = content[self.sent_content:]
        self.sent_reasoning += len(new_reasoning)
        self.sent_content += len(new_content)
        return new_reasoning, new_content
