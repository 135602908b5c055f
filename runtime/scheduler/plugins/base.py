"""The scheduler's plug-in seam: parts that hold requests outside its queues attach through these hooks.

A plug-in (the grammar queue, a prefill/decode disaggregation side, pause and continue, weight updates,
speculative decoding) is built with the scheduler's handle, sees each request and batch at the points below, and
acts back only through that handle (tests/test_layering.py holds it to this: a plug-in imports nothing of the
scheduler package but this seam, the request type and the memory manager). The loop calls every plug-in at each
point; none of them has a branch of its own in the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ...cache.base import PrefixCache
    from ...config import EngineArgs
    from ...executor.batch import ReqSlice
    from ...executor.model_runner import ModelRunner
    from ...wire.finish_reason import FinishReason
    from ..memory import MemoryManager
    from ..req import Req


class SchedulerHandle(Protocol):
    """What a plug-in may use of the scheduler."""

    args: EngineArgs
    runner: ModelRunner
    cache: PrefixCache
    memory: MemoryManager
    running: list[Req]

    def enqueue(self, req: Req) -> None:
        """Hand over a request that is ready to run (it reaches the other plug-ins' take_ready first)."""

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Answer a request; the caller has released or kept its memory."""

    def start_decoding(self, req: Req, token: int, logprob: float | None, top: list | None) -> None:
        """A request whose prompt K/V were computed elsewhere joins the running batch with its first token."""

    def drain(self) -> None:
        """Fold in the batch in flight (the overlap loop's), so that every sampled token is in its request."""

    def live_requests(self) -> list[Req]:
        """Every request the scheduler's own queues hold: waiting, running, and the one prefilled in chunks."""

    def kv_holders(self) -> int:
        """Requests of the scheduler's that hold K/V now: the running ones and the one prefilled in chunks."""

    def held_requests(self) -> list[Req]:
        """Requests whose memory a plug-in holds (a disaggregation side's transfers)."""

    def abort(self, rid: str, reason: FinishReason | None = None) -> None:
        """End the requests with this id, wherever they are, and free what they hold."""

    def retract_all(self) -> None:
        """Put every running request (and a half-prefilled one) back at the head of the queue, its K/V freed."""


class SchedulerPlugin:
    """Every hook defaults to doing nothing; a plug-in overrides those it needs."""

    def take_new(self, req: Req) -> bool:
        """A request just arrived. True: this plug-in holds it and enqueues it when it is ready (or finishes it)."""
        return False

    def take_ready(self, req: Req) -> bool:
        """A request is ready to run. True: this plug-in holds it before it may run (its prompt K/V come first)."""
        return False

    def take_finished(self, req: Req) -> bool:
        """A request just finished. True: this plug-in keeps its memory and answers it later."""
        return False

    @property
    def blocks_forwards(self) -> bool:
        """Nothing may be scheduled now (generation paused, weights or K/V memory released)."""
        return False

    def shape_decode(self, decoding: list[ReqSlice], room: int) -> None:
        """A pure decode batch is being laid out, with `room` KV slots to spare: the plug-in may add tokens to its
        slices (speculative drafts)."""

    def tokens_taken(self, req: Req, piece: ReqSlice, emitted: int, taken: int) -> None:
        """The scheduler took `taken` of the `emitted` tokens of a request's slice (a stop cuts the rest)."""

    def advance(self) -> None:
        """Once per loop round, on the scheduler thread: settle what finished in the background."""

    @property
    def pending(self) -> bool:
        """Requests wait on work in the background: the loop polls instead of blocking on messages."""
        return False

    def remove(self, rid: str) -> list[Req]:
        """An abort: the requests with this id that wait here, no longer held (they own no memory)."""
        return []

    def holding(self) -> list[Req]:
        """Requests whose memory this plug-in holds, for the integrity check and aborts."""
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def rpc_handlers(self) -> dict[type, Callable[[Any], Any]]:
        """Control calls this plug-in answers: the call's type (wire/control_calls.py) -> its handler."""
        return {}

    def close(self) -> None:
        """The loop stopped."""
