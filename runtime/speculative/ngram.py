"""N-gram (prompt-lookup) drafting: a request's next tokens are guessed from its own prompt and output.

For the last n tokens (longest n first, within the configured window), find their latest earlier occurrence and
propose the tokens that followed it. No model runs: text that quotes or copies its prompt (extraction, JSON that
repeats fields, code edits) is drafted right often; free text rarely matches, and then nothing is proposed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .drafter import Drafter, DraftRequest

if TYPE_CHECKING:
    from ..config import EngineArgs
    from ..executor.model_runner import ModelRunner


class NgramIndex:
    """One request's tokens, and for each n-gram of a matched length, the position where it last ended with a
    token after it. Grows as the request does (its tokens are only ever appended), so a step costs O(window)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # Keys of every length share one dict: a tuple's length tells them apart.
        self.latest: dict[tuple[int, ...], int] = {}

    def sync(self, input_ids: list[int], output_ids: list[int]) -> None:
        """Take in whatever of prompt + output this index has not seen yet."""
        known = len(self.tokens)
        if known < len(input_ids):
            self.extend(input_ids[known:])
            known = len(input_ids)
        self.extend(output_ids[known - len(input_ids) :])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._push(token)

    def _push(self, token: int) -> None:
        # The n-grams ending at the current last position now have a follower, so they can be drafted from.
        end = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self.latest[tuple(self.tokens[end - n : end])] = end - 1
        self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix; [] if none."""
        size = len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self.latest.get(tuple(self.tokens[size - n :]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + k]
        return []


class NgramDrafter(Drafter):
    """The NGRAM speculative_algorithm: each request keeps an NgramIndex over its text (in req.draft_state, so it
    goes with the request: nothing to release)."""

    reads_images = True  # it copies ids; the Speculator cuts a draft before any image pad

    def __init__(self, args: EngineArgs, target: ModelRunner | None = None) -> None:
        self.min_n = args.speculative_ngram_min_match_window_size
        self.max_n = args.speculative_ngram_max_match_window_size

    def propose(self, reqs: list[DraftRequest], limits: list[int]) -> list[list[int]]:
        return [self.propose_one(req, limit) if limit > 0 else [] for req, limit in zip(reqs, limits)]

    def propose_one(self, req: DraftRequest, limit: int) -> list[int]:
        if req.draft_state is None:
            req.draft_state = NgramIndex(self.min_n, self.max_n)
        req.draft_state.sync(req.input_ids, req.output_ids)
        return req.draft_state.propose(limit)
