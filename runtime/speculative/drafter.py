"""What the scheduler's Speculator (scheduler/plugins/speculation.py) asks of a drafter, whichever algorithm it is."""

from __future__ import annotations

from typing import Any, Protocol

from ..sampling.sampler import SamplingRow


class DraftRequest(Protocol):
    """What a drafter reads of a request (the scheduler's Req): its ids so far, its sampling, and a slot for the
    drafter's own per-request state."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    draft_state: Any

    @property
    def fill_ids(self) -> list[int]: ...

    def sampling_row(self) -> SamplingRow: ...


class Drafter:
    """Proposes the next tokens of a decode batch's requests, all at once (a draft model runs one forward per draft
    position for the whole batch). Its per-request state is its own; the hooks below say when to drop it."""

    # A draft model reads token ids only: a prompt that shows images (their positions hold hash pads past the
    # vocabulary) is not drafted for. Drafters that only copy ids (n-gram) draft for it.
    reads_images = False

    def propose(self, reqs: list[DraftRequest], limits: list[int]) -> list[list[int]]:
        """Per request, at most limits[i] tokens guessed to follow its prompt and output ([] when limit is 0)."""
        raise NotImplementedError

    def release(self, req: DraftRequest) -> None:
        """The request finished: free what the drafter holds for it."""

    def release_rid(self, rid: str) -> None:
        """The request with this id was aborted, wherever it was."""

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """The scheduler loop stopped."""
