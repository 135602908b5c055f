"""The role a program's text is in, from its begin to its end: where its content starts, the images it shows, and
the whitespace the chat template writes before the content that a generation may write instead."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..runtime.multimodal.content_parts import image_part, text_part


@dataclass(frozen=True)
class ShownImage:
    start: int  # where the image's text starts in the program's text
    end: int
    source: Any


@dataclass
class OpenRole:
    role: str
    begin: int  # where the content starts in the program's text
    held: str = ""  # whitespace of the prefix not written yet (ChatTemplate.generation_tail)
    left_to_model: str = ""  # the held whitespace a generation was left to write
    images: list[ShownImage] = field(default_factory=list)

    def copy(self) -> OpenRole:
        return replace(self, images=list(self.images))

    def has_text(self, text: str) -> bool:
        """Whether the content so far holds text besides its images."""
        return any(part["type"] == "text" for part in self.parts(text))

    def ends_with_image(self, text: str) -> bool:
        return bool(self.images) and self.images[-1].end == len(text)

    def plain(self, text: str) -> str:
        """The content as a message's text."""
        return text[self._content_start(text):]

    def parts(self, text: str) -> list[dict[str, Any]]:
        """The content as a message's parts: its text runs and images in order, empty runs left out."""
        parts, start = [], self._content_start(text)
        for image in self.images:
            parts += _text_run(text[start:image.start]) + [image_part(image.source)]
            start = image.end
        return parts + _text_run(text[start:])

    def _content_start(self, text: str) -> int:
        """Where the message's content starts: past the whitespace a generation wrote in the template's place."""
        if self.left_to_model and text.startswith(self.left_to_model, self.begin):
            return self.begin + len(self.left_to_model)
        return self.begin


def _text_run(text: str) -> list[dict[str, Any]]:
    return [text_part(text)] if text else []
