"""Pausing and continuing generation, and flushing the prefix cache, as RL trainers drive them between rounds.

pause_generation(mode): abort returns every request at once with what it has generated and finish_reason abort
(clients resubmit prompt + partial output); retract puts running requests back in the queue and frees their K/V
(what they cached becomes evictable, so a flush succeeds); in_place keeps them as they are, their K/V held. While
paused nothing is scheduled; new requests queue. A flush never fails because aborted requests are still settling
(a disaggregated transfer winding down): it waits for them, up to FLUSH_WAIT_S.
"""

from __future__ import annotations

import time
from typing import Any

from ...wire.control_calls import AbortAll, ContinueGeneration, FlushCache, PauseGeneration
from ...wire.finish_reason import FinishReason
from ...wire.messages import ControlResult
from ...wire.weight_messages import PAUSE_MODES, check_choice
from .base import SchedulerHandle, SchedulerPlugin
from .rpc import NOT_YET, Deferred, Handler

FLUSH_WAIT_S = 30.0


class GenerationControl(SchedulerPlugin):
    def __init__(self, scheduler: SchedulerHandle) -> None:
        self.scheduler = scheduler
        self.paused_mode: str | None = None

    @property
    def paused(self) -> bool:
        return self.paused_mode is not None

    @property
    def blocks_forwards(self) -> bool:
        return self.paused

    def rpc_handlers(self) -> dict[type, Handler]:
        return {PauseGeneration: self.pause, ContinueGeneration: self.resume, FlushCache: self.flush,
                AbortAll: lambda _: ControlResult(True, f"aborted {self.abort_all()} request(s)")}

    def pause(self, call: PauseGeneration) -> ControlResult:
        mode = check_choice("mode", call.mode, PAUSE_MODES)
        s = self.scheduler
        s.drain()  # the overlap loop's batch in flight lands first: its tokens belong to the outputs
        affected = s.kv_holders()
        if mode == "abort":
            affected = self.abort_all("generation paused (abort): resubmit prompt and output to continue")
        elif mode == "retract":
            s.retract_all()
        self.paused_mode = mode
        return ControlResult(True, f"generation paused ({mode}): {affected} request(s) affected")

    def resume(self, _: ContinueGeneration) -> ControlResult:
        was, self.paused_mode = self.paused_mode, None
        return ControlResult(True, "generation continues" if was else "generation was not paused")

    def abort_all(self, why: str = "aborted by request") -> int:
        s = self.scheduler
        rids = {req.rid for req in s.live_requests()}
        rids |= {req.rid for req in s.held_requests() if not req.finished}
        for rid in rids:
            s.abort(rid, FinishReason.abort(why))
        return len(rids)

    def flush(self, _: FlushCache) -> ControlResult | Deferred:
        blocked = self.flush_blocked()
        if blocked is None:
            return self._flushed()
        if blocked:
            return ControlResult(False, f"cache not flushed: {blocked}")
        deadline = time.monotonic() + FLUSH_WAIT_S

        def poll() -> Any:
            reason = self.flush_blocked()
            if reason is None:
                return self._flushed()
            if reason or time.monotonic() > deadline:
                return ControlResult(False, f"cache not flushed: {reason or 'aborted requests did not settle'}")
            return NOT_YET

        return Deferred(poll)

    def flush_blocked(self) -> str | None:
        """Why a flush cannot run now: None, it can; "" only aborted requests still settle (wait for them)."""
        s = self.scheduler
        live = s.kv_holders()
        if live:
            how = ("they were paused in place; pause with mode 'retract' or 'abort' to flush"
                   if self.paused_mode == "in_place" else "pause generation first, or wait for them")
            return f"{live} running request(s) hold K/V in it ({how})"
        held = s.held_requests()
        if any(not req.finished for req in held):
            return f"{len(held)} request(s) are transferring K/V"
        return "" if held else None

    def _flushed(self) -> ControlResult:
        if not self.scheduler.cache.flush():
            return ControlResult(False, "cache not flushed: requests still hold parts of it")
        return ControlResult(True, "cache flushed")
