"""A chat template seen through short conversations of sentinel texts: each rendered with
`tokenizer.apply_chat_template` and cut where its sentinels stand, so what the template writes around a message's
content (role markers, an image part's text) can be read off the pieces.

A template reads a message's text either from a string or from content parts (LLaVA-1.5's renders a plain string
as nothing); the probe writes its messages in the form the template shows, strings where both work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..runtime.multimodal.content_parts import text_part

SENTINELS = ("\u2063furcate-content-a\u2063", "\u2063furcate-content-b\u2063", "\u2063furcate-content-c\u2063")
# Conversations that show a template's text form: one of them renders under any template that takes that form.
TEXT_FORM_PROBES: tuple[tuple[str, ...], ...] = (("user",), ("system", "user"), ("user", "assistant"))


def sentinel(index: int) -> str:
    return SENTINELS[index % len(SENTINELS)] + str(index)


def texts_of(message: dict[str, Any]) -> list[str]:
    """The texts a message holds: its string content, or its text parts' texts in order."""
    content = message["content"]
    return [content] if isinstance(content, str) else [part["text"] for part in content if part["type"] == "text"]


@dataclass
class TemplateProbe:
    """Renders with `tokenizer.apply_chat_template`; `template` overrides the tokenizer's own."""

    tokenizer: Any
    template: str | None = None
    _text_as_parts: bool | None = None

    def render(self, messages: list[dict[str, Any]], generation: bool = False) -> str:
        if self.template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template, so roles cannot be rendered; pass "
                             "chat_template=... to the backend")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                  add_generation_prompt=generation)

    def message(self, role: str, text: str) -> dict[str, Any]:
        """A message of `text` in the form the template shows: a string, or one text part."""
        return {"role": role, "content": [text_part(text)] if self.text_as_parts() else text}

    def text_as_parts(self) -> bool:
        """Whether the template shows a message's text only from content parts."""
        if self._text_as_parts is None:
            self._text_as_parts = not self._shows_text(as_parts=False) and self._shows_text(as_parts=True)
        return self._text_as_parts

    def pieces(self, roles: tuple[str, ...], generation: bool = False) -> list[str] | None:
        """The rendering of a conversation of `roles`, each message's content a distinct sentinel, cut at them."""
        return self.cut([self.message(role, sentinel(i)) for i, role in enumerate(roles)], generation)

    def cut(self, messages: list[dict[str, Any]], generation: bool = False) -> list[str] | None:
        """The rendering of `messages` (every text of theirs a distinct sentinel) cut at their texts: the text
        before the first, between each two, after the last. None: the template refuses that conversation or does
        not show every text once, in order."""
        try:
            text = self.render(messages, generation)
        except Exception:  # noqa: BLE001 - templates raise anything on orders they refuse
            return None
        pieces = []
        for content in (text for message in messages for text in texts_of(message)):
            head, found, text = text.partition(content)
            if not found or content in text:
                return None
            pieces.append(head)
        return [*pieces, text]

    def _shows_text(self, as_parts: bool) -> bool:
        for roles in TEXT_FORM_PROBES:
            messages = [{"role": role, "content": [text_part(sentinel(i))] if as_parts else sentinel(i)}
                        for i, role in enumerate(roles)]
            if self.cut(messages) is not None:
                return True
        return False
