"""Role markers taken from the model's own chat template (the tokenizer's Jinja template, via transformers).

A role's markers are found by rendering short conversations whose messages hold sentinels and cutting the
rendering at them, so the text a program builds with roles is what `apply_chat_template` gives for the same
messages. Templates differ in what sits between two messages, so a role's prefix is kept per previous role:
Gemma 3 folds the system message into the first user turn (nothing but a blank line between them), OLMo 2 ends an
assistant turn with EOS and starts the next user turn with a newline. What a template appends only to a finished
conversation (Phi-3's EOS, when no generation prompt follows) is left out of a role's suffix: the text a program
continues from is the conversation so far, as a generation prompt would see it. Where the generation prompt stops
short of the assistant's prefix by whitespace (LLaVA's `ASSISTANT:` before `ASSISTANT: ` + content), an answer
generated there starts from the prompt. How an image shows in a message is measured the same way
(image_markers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .image_markers import ImageMarkers, find_image_markers
from .template_probe import SENTINELS, TemplateProbe

ROLES = ("system", "user", "assistant")
# Conversations put before the messages being measured, so that templates that insist on an order (a user turn
# first, roles alternating) render them.
CONTEXTS: tuple[tuple[str, ...], ...] = ((), ("user",), ("user", "assistant"), ("system",), ("system", "user"))
# What may follow a role's first message so that a template that renders nothing for it alone (Gemma 3's system
# message, held until the user turn it is folded into) shows it.
FOLLOWERS: tuple[tuple[str, ...], ...] = ((), ("user",), ("assistant",))


@dataclass(frozen=True)
class RoleMarkers:
    first_prefix: str | None  # before the content of the conversation's first message; None: the template refuses
    prefix: str  # before the content otherwise (after an assistant turn, or whatever previous role renders)
    suffix: str  # after the content
    after: Mapping[str, str] = field(default_factory=dict)  # previous role -> the prefix after it, where it differs
    refusal: str = ""  # why the template refuses a conversation this role opens

    def prefix_after(self, previous: str | None) -> str:
        """The text before this role's content when the message before it had role `previous` (None: none)."""
        if previous is not None:
            return self.after.get(previous, self.prefix)
        if self.first_prefix is None:
            raise ValueError(self.refusal)
        return self.first_prefix


@dataclass
class ChatTemplate:
    """Role and image markers of `tokenizer`'s chat template; `template` (a Jinja string) overrides its own."""

    tokenizer: Any
    template: str | None = None
    _markers: dict[str, RoleMarkers] = field(default_factory=dict)
    _suffixes: dict[str, str] = field(default_factory=dict)
    _tails: dict[str, str] = field(default_factory=dict)
    _images: dict[str, ImageMarkers | None] = field(default_factory=dict)
    _default_system: str | None = None
    _default_system_known: bool = False
    probe: TemplateProbe = field(init=False)

    def __post_init__(self) -> None:
        self.probe = TemplateProbe(self.tokenizer, self.template)

    def markers(self, role: str) -> RoleMarkers:
        if role not in self._markers:
            self._markers[role] = self._find_markers(role)
        return self._markers[role]

    def default_system_prompt(self) -> str | None:
        """The system message the template inserts when a conversation starts with another role, if any."""
        if not self._default_system_known:
            self._default_system = self._find_default_system()
            self._default_system_known = True
        return self._default_system

    def message(self, role: str, text: str) -> dict[str, Any]:
        """A message of `text` as the template reads it: a string, or one text part (LLaVA-1.5's template)."""
        return self.probe.message(role, text)

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.probe.render(messages)

    def generation_tail(self, previous: str) -> str:
        """Whitespace that ends the assistant's prefix after a `previous` message but not the template's
        generation prompt (LLaVA's renders 'ASSISTANT: ' before an answer, and prompts with 'ASSISTANT:'): a
        generation there starts from the prompt and writes that whitespace itself."""
        if previous not in self._tails:
            self._tails[previous] = self._find_generation_tail(previous)
        return self._tails[previous]

    def image_markers(self, role: str, placeholder: str) -> ImageMarkers | None:
        """How the template shows an image in a `role` message; None: it renders no image parts (a template
        written for strings), and an image shows as the model's `placeholder` where it stands."""
        if role not in self._images:
            self._images[role] = find_image_markers(self.probe, role, placeholder, self._suffix(role))
        return self._images[role]

    def _find_markers(self, role: str) -> RoleMarkers:
        first = self._first_prefix(role)
        after = {previous: between[len(self._suffix(previous)):] for previous in ROLES
                 if (between := self._between(previous, role)) is not None
                 and between.startswith(self._suffix(previous))}
        suffix = self._suffix(role)
        prefix = after.get("assistant", after.get("user", first))
        if prefix is None:
            raise ValueError(f"the chat template cannot render a {role!r} message{self._refusal(role)}")
        refusal = "" if first is not None else (f"the chat template cannot open a conversation with a {role!r} "
                                                f"message{self._refusal(role)}")
        return RoleMarkers(first_prefix=first, prefix=prefix, suffix=suffix, after=after, refusal=refusal)

    def _first_prefix(self, role: str) -> str | None:
        for followers in FOLLOWERS:
            pieces = self.probe.pieces((role, *followers))
            if pieces is not None:
                return pieces[0]
        return None

    def _between(self, previous: str, role: str) -> str | None:
        """The text between a `previous` message's content and a `role` message's content right after it."""
        for context in CONTEXTS:
            pieces = self.probe.pieces((*context, previous, role))
            if pieces is not None:
                return pieces[-2]
        return None

    def _after_last(self, role: str) -> str | None:
        """The text after a `role` message's content when it ends the conversation."""
        for context in CONTEXTS:
            pieces = self.probe.pieces((*context, role))
            if pieces is not None:
                return pieces[-1]
        return None

    def _suffix(self, role: str) -> str:
        """What closes a `role` message whatever follows it: the text after it at the end of a conversation, less
        an end-of-conversation EOS the text before a next message lacks. A role whose first message shows only
        once another follows (folded into it) closes with nothing; its text goes to the next role's prefix."""
        if role not in self._suffixes:
            self._suffixes[role] = self._closing_text(role)
        return self._suffixes[role]

    def _closing_text(self, role: str) -> str:
        folded = self.probe.pieces((role,)) is None and self._first_prefix(role) is not None
        last = None if folded else self._after_last(role)
        if last is None:
            return ""
        followers = [between for nxt in ROLES if (between := self._between(role, nxt)) is not None]
        eos = getattr(self.tokenizer, "eos_token", None) or ""
        if eos and last.endswith(eos) and not all(text.startswith(last) for text in followers):
            last = last[: -len(eos)]
        return last

    def _find_generation_tail(self, previous: str) -> str:
        between = self._between(previous, "assistant")
        for context in CONTEXTS:
            pieces = self.probe.pieces((*context, previous), generation=True)
            if pieces is not None:
                prompt = pieces[-1]
                tail = between[len(prompt):] if between is not None and between.startswith(prompt) else ""
                return tail if tail.isspace() else ""
        return ""

    def _refusal(self, role: str) -> str:
        """The template's own words for why it refuses a conversation opened by `role` (Gemma 2: 'System role
        not supported'), or nothing when it renders one."""
        try:
            self.render([self.message(role, SENTINELS[0]), self.message("user", SENTINELS[1])])
        except Exception as error:  # noqa: BLE001 - templates raise anything on orders they refuse
            return f": {error}"
        return ""

    def _find_default_system(self) -> str | None:
        try:
            system = self.markers("system")
            user = self.markers("user")
        except ValueError:
            return None
        head = system.first_prefix
        if head is None:
            return None
        tail = system.suffix + user.prefix_after("system")
        text = user.first_prefix
        if user.first_prefix == user.prefix or not text.startswith(head) or not text.endswith(tail):
            return None
        default = text[len(head): len(text) - len(tail)] or None
        return default if default is not None and self._renders_as_default(default) else None

    def _renders_as_default(self, default: str) -> bool:
        """Whether the found default, sent back as a system message, renders as the template's own default does
        (SmolLM3's removes '/think' from any system message, its own default's '</think>' included: there the
        default stays part of the user's first prefix, not a message)."""
        probe = self.message("user", SENTINELS[0])
        try:
            return self.render([self.message("system", default), probe]) == self.render([probe])
        except Exception:  # noqa: BLE001 - templates raise anything on orders they refuse
            return False
