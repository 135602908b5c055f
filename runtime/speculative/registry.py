"""The speculative algorithms by name (engine argument speculative_algorithm), beside their drafters: config's
validation and CLI choices and the speculation plug-in's lookup all read these entries (runtime/registry.py).

Each drafter is named by import path, so naming one imports neither it nor torch.
"""

from __future__ import annotations

from .. import registry

KIND = "speculative_algorithm"
NGRAM = "NGRAM"
STANDALONE = "STANDALONE"  # a small draft model of the target's vocabulary proposes the tokens

registry.register(KIND, NGRAM, f"{__package__}.ngram:NgramDrafter")
registry.register(KIND, STANDALONE, f"{__package__}.draft_model:StandaloneDrafter")
