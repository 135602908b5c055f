"""Role markers taken from the model's own chat template (the tokenizer's Jinja template, via transformers).

A role's prefix and suffix are found by rendering a conversation whose message holds a sentinel and cutting
the rendering at it, so the text a program builds with roles is what `apply_chat_template` gives for the same
messages. The first message may differ (a BOS, a default system prompt the template inserts); both are found
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SENTINEL = "\u2063furcate-content\u2063"
# Conversations a role's message is appended to, to see its text when it is not the first message.
CONTEXTS = {
    "system": [[{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}], []],
    "user": [[{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}],
             [{"role": "system", "content": "A"}]],
    "assistant": [[{"role": "user", "content": "A"}], [{"role": "system", "content": "A"}]],
}


@dataclass(frozen=True)
class RoleMarkers:
    first_prefix: str  # before the content when this role's message is the conversation's first
    prefix: str  # before the content otherwise
    suffix: str  # after the content


@dataclass
class ChatTemplate:
    """Renders role markers with `tokenizer.apply_chat_template`; `template` overrides the tokenizer's own."""

    tokenizer: Any
    template: str | None = None
    _markers: dict[str, RoleMarkers] = field(default_factory=dict)
    _default_system: str | None = None
    _default_system_known: bool = False

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

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template, so roles cannot be rendered; pass "
                             "chat_template=... to the backend")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template)

    def _find_markers(self, role: str) -> RoleMarkers:
        later = None
        for context in CONTEXTS[role]:
            try:
                later = self._segment(context, role)
                break
            except (ValueError, Exception):  # noqa: BLE001 - templates raise anything on orders they refuse
                continue
        try:
            first = self._segment([], role)
        except Exception:  # noqa: BLE001 - a template that cannot render one role alone falls back to `later`
            first = later
        if later is None:
            later = first
        if first is None:
            raise ValueError(f"the chat template cannot render a {role!r} message")
        return RoleMarkers(first_prefix=first[0], prefix=later[0], suffix=later[1])

    def _segment(self, context: list[dict[str, str]], role: str) -> tuple[str, str]:
        """(prefix, suffix) around the content of a `role` message appended to `context`."""
        base = self.render(context) if context else ""
        full = self.render(context + [{"role": role, "content": SENTINEL}])
        if not full.startswith(base) or full.count(SENTINEL) != 1:
            raise ValueError(f"the chat template renders a {role!r} message in a way roles cannot follow")
        prefix, suffix = full[len(base):].split(SENTINEL)
        return prefix, suffix

    def _find_default_system(self) -> str | None:
        try:
            system = self.markers("system")
            user = self.markers("user")
        except ValueError:
            return None
        head = system.first_prefix
        tail = system.suffix + user.prefix
        text = user.first_prefix
        if user.first_prefix == user.prefix or not text.startswith(head) or not text.endswith(tail):
            return None
        return text[len(head): len(text) - len(tail)] or None
