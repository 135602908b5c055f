"""Requests waiting for their grammar to compile (a scheduler plug-in); none of them holds up the batch."""

from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import Future

import torch

from ....grammars.auto import approximation_refused
from ....grammars.base import allocate_bitmask
from ....grammars.cache import GrammarCache
from ...wire.finish_reason import FinishReason
from ..req import Req
from .base import SchedulerHandle, SchedulerPlugin


class GrammarQueue(SchedulerPlugin):
    """Takes each constrained request as it arrives, compiles its grammar on the cache's pool, and enqueues it
    with its matcher attached (or fails it alone); fills the grammar masks of every batch."""

    def __init__(self, scheduler: SchedulerHandle, cache: GrammarCache | None, timeout_s: float) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self.timeout_s = timeout_s
        # Under grammar_backend="auto" a grammar that only approximates its spec serves only requests that allow it;
        # a backend named explicitly serves its approximations, as the user chose it.
        self.exact_only = scheduler.args.grammar_backend == "auto"
        self.waiting: list[tuple[Req, Future]] = []
        self.fill_seconds: deque[float] = deque(maxlen=50_000)  # per request-token mask fill times

    def stats(self) -> dict[str, float | int]:
        """Grammar compile times (ms) and per request-token mask fill times (us), p50 and p99."""
        compile_ms = [s * 1e3 for s in self.cache.compile_seconds] if self.cache else []
        fill_us = [s * 1e6 for s in self.fill_seconds]
        return {"grammar_compiles": len(compile_ms), "grammar_compile_p50_ms": percentile(compile_ms, 50),
                "grammar_compile_p99_ms": percentile(compile_ms, 99), "mask_fills": len(fill_us),
                "mask_fill_p50_us": percentile(fill_us, 50), "mask_fill_p99_us": percentile(fill_us, 99)}

    @property
    def pending(self) -> bool:
        return bool(self.waiting)

    def take_new(self, req: Req) -> bool:
        if req.params.grammar is None:
            return False
        if (problem := self.add(req)) is not None:
            self.scheduler.finish(req, FinishReason.bad_request(problem))
        return True

    def advance(self) -> None:
        ready, failed = self.pop_settled()
        for req in ready:
            self.scheduler.enqueue(req)
        for req, problem in failed:
            self.scheduler.finish(req, FinishReason.bad_request(problem))

    def add(self, req: Req) -> str | None:
        """Start compiling; returns an error message when the request cannot be constrained at all."""
        if self.cache is None:
            return "constrained decoding needs a grammar backend (grammar_backend is 'none')"
        self.waiting.append((req, self.cache.get(req.params.grammar)))
        return None

    def pop_settled(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Requests whose grammar compiled (matcher attached) and those that failed, with the reason."""
        ready, failed, still = [], [], []
        now = time.monotonic()
        for req, future in self.waiting:
            # The clock starts when the compile does: time queued behind other compiles does not count.
            started = self.cache.started_at(req.params.grammar)
            if future.done():
                problem = self._attach_matcher(req, future)
                if problem is None:
                    ready.append(req)
                else:
                    failed.append((req, problem))
            elif started is not None and now - started > self.timeout_s:
                failed.append((req, f"{req.params.grammar.kind} did not compile within {self.timeout_s:g}s"))
            else:
                still.append((req, future))
        self.waiting = still
        return ready, failed

    def _attach_matcher(self, req: Req, future: Future) -> str | None:
        """Give `req` its grammar's matcher; the reason instead when the grammar failed or may not serve it."""
        try:
            compiled = future.result()
            if self.exact_only and not compiled.fidelity.exact and not req.params.allow_approximate_schema:
                return approximation_refused(req.params.grammar, compiled)
            req.matcher = compiled.matcher()
            return None
        except ValueError as error:
            return str(error)
        except Exception as error:  # noqa: BLE001 - a backend's own failure fails this request only
            return f"{req.params.grammar.kind} failed to compile: {type(error).__name__}: {error}"

    def remove(self, rid: str) -> list[Req]:
        gone = [entry[0] for entry in self.waiting if entry[0].rid == rid]
        self.waiting = [entry for entry in self.waiting if entry[0].rid != rid]
        return gone

    def fill_masks(self, reqs: list[Req], vocab_size: int) -> tuple[torch.Tensor | None, list[int]]:
        """Bitmask rows for the constrained ones among `reqs` (sampling order), and which rows those are."""
        # A request that finished while its batch was in flight (overlap loop) needs no mask: its token is dropped.
        constrained = [i for i, req in enumerate(reqs) if req.matcher is not None and not req.finished]
        if not constrained:
            return None, []
        bitmask = allocate_bitmask(len(reqs), vocab_size)
        for i in constrained:
            started = time.perf_counter()
            reqs[i].matcher.fill_bitmask(bitmask, i)
            self.fill_seconds.append(time.perf_counter() - started)
        return bitmask, constrained


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
