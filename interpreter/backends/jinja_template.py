"""A chat template that lives apart from a tokenizer (a server's, or a fixed one), rendered as a tokenizer would."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class JinjaTemplateTokenizer:
    """Stands in for a tokenizer where ChatTemplate needs one: renders the Jinja `chat_template` with transformers'
    own renderer and the tokenizer's special-token variables, so the text equals what that tokenizer's
    `apply_chat_template` gives."""

    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            chat_template: str | None = None, add_generation_prompt: bool = False) -> str:
        # transformers is imported here, on first use: importing a backend stays light.
        from transformers.utils.chat_template_utils import render_jinja_template

        if tokenize:
            raise ValueError("a chat template without its tokenizer renders text only")
        rendered, _ = render_jinja_template([messages], chat_template=chat_template or self.chat_template,
                                            add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return rendered[0]
