"""How a chat template shows an image part of a message (HF's `{"type": "image"}`), measured as role markers are:
by rendering messages of sentinel texts with and without an image and comparing the pieces.

LLaVA's template writes `<image>\\n` for each image, all of a message's images before its text, and closes each
text part with a space; Qwen2-VL's writes `<|vision_start|><|image_pad|><|vision_end|>` where the image stands. A
program's image then appends that text where it stands, which is the template's own rendering whenever the template
keeps parts in order, or the image comes before any text of its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..runtime.multimodal.content_parts import image_part, shows_image_parts, text_part
from .template_probe import TemplateProbe, sentinel

CONTEXTS: tuple[tuple[str, ...], ...] = ((), ("user",), ("user", "assistant"), ("system",))
FOLLOWERS = ("assistant", "user")


@dataclass(frozen=True)
class ImageMarkers:
    text: str  # what an image part renders as
    after_text: bool  # whether an image may follow text in its message (the template keeps parts in order)
    closing: str  # what closes a message whose content ends with an image (LLaVA's: nothing, its space is text's)


def find_image_markers(probe: TemplateProbe, role: str, placeholder: str, suffix: str) -> ImageMarkers | None:
    """The markers of an image in a `role` message, whose text parts end with `suffix`; None: the template shows
    no image parts at all. A template that shows them, but not in this role or not as one `placeholder`, is a
    ValueError."""
    if not shows_image_parts(probe.render, placeholder):
        return None
    for context in CONTEXTS:
        found = _markers_after(Conversation(probe, context, role), suffix)
        if found is not None:
            return _checked(found, role, placeholder)
    raise ValueError(f"the chat template cannot show an image in a {role!r} message (it refuses every conversation "
                     f"that would show one, or shows each image of a message its own way)")


def _checked(found: ImageMarkers, role: str, placeholder: str) -> ImageMarkers:
    if not found.text:
        raise ValueError(f"the chat template shows no image in a {role!r} message")
    if found.text.count(placeholder) != 1:
        raise ValueError(f"the chat template shows an image in a {role!r} message as {found.text!r}, not as the "
                         f"model's image placeholder {placeholder!r}")
    return found


@dataclass(frozen=True)
class Conversation:
    """Messages of sentinels in `context`, then a `role` message whose content is the parts a measurement asks."""

    probe: TemplateProbe
    context: tuple[str, ...]
    role: str

    def cut(self, parts: list[dict[str, Any]], follower: str | None = None) -> list[str] | None:
        """The rendering cut at its texts, with a `follower` message after the measured one if given."""
        messages = [self.probe.message(role, sentinel(i)) for i, role in enumerate(self.context)]
        messages.append({"role": self.role, "content": parts})
        if follower is not None:
            messages.append(self.probe.message(follower, self.text(1)))
        return self.probe.cut(messages)

    def text(self, index: int) -> str:
        """A text part's sentinel, distinct from the context's."""
        return sentinel(len(self.context) + index)


def _markers_after(conversation: Conversation, suffix: str) -> ImageMarkers | None:
    """The markers read off messages with and without images after the conversation's context; None: the
    template refuses one of them, or shows an image differently when another precedes it."""
    text = text_part(conversation.text(0))
    plain = conversation.cut([text])
    shown = conversation.cut([image_part(), text])
    if plain is None or shown is None or shown[:-2] != plain[:-2] or shown[-1] != plain[-1]:
        return None
    if not shown[-2].startswith(plain[-2]):
        return None
    image = shown[-2][len(plain[-2]):]
    twice = conversation.cut([image_part(), image_part(), text])
    if twice is None or twice[-2] != plain[-2] + image * 2:
        return None
    closing = _closing_after_image(conversation, suffix)
    if closing is None:
        return None
    return ImageMarkers(image, _keeps_order(conversation, plain[-2], image), closing)


def _keeps_order(conversation: Conversation, opening: str, image: str) -> bool:
    """Whether text, an image, then text renders as the texts with the image's text between them and nothing
    else: the template keeps parts in order and adds nothing around them."""
    pieces = conversation.cut([text_part(conversation.text(0)), image_part(), text_part(conversation.text(1))])
    return pieces is not None and pieces[-3] == opening and pieces[-2] == image


def _closing_after_image(conversation: Conversation, suffix: str) -> str | None:
    """What closes the message when its content ends with an image: measured against the same message ending
    with a text part (which `suffix` closes), each with a next message after it."""
    for follower in FOLLOWERS:
        texted = conversation.cut([image_part(), text_part(conversation.text(0))], follower)
        bare = conversation.cut([image_part()], follower)
        if texted is None or bare is None or not texted[-2].startswith(suffix):
            continue
        next_prefix = texted[-2][len(suffix):]
        rest = bare[-2][len(texted[-3]):] if bare[-2].startswith(texted[-3]) else None
        if rest is not None and rest.endswith(next_prefix):
            return rest[: len(rest) - len(next_prefix)]
    return None
