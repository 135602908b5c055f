"""Compiled grammars cached by spec in a bounded LRU, compiled on a thread pool so no schema stalls the loop. The
backend itself may be built on that pool too (GrammarCache.building), so an engine serves before its grammar tables
exist."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .base import CompiledGrammar, GrammarBackend, GrammarSpec


class GrammarCache:
    def __init__(self, backend: GrammarBackend, max_entries: int = 256, workers: int = 2) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="furcate-grammar")
        self._backend: Future[GrammarBackend] = Future()
        self._backend.set_result(backend)
        self.compile_seconds: deque[float] = deque(maxlen=10_000)
        self._started: dict[GrammarSpec, float] = {}  # time.monotonic() when each compile began running

    @classmethod
    def building(cls, build: Callable[[], GrammarBackend], max_entries: int = 256, workers: int = 2) -> GrammarCache:
        """A cache whose backend `build()` makes on the cache's pool (grammar_backend="auto"'s tokenizer tables take
        ~2.6 s on 2 cores): compiles wait for it, and a build that fails fails each compile with its error."""
        cache = cls(None, max_entries, workers)  # type: ignore[arg-type] - replaced by the build's future below
        cache._backend = cache._pool.submit(build)
        return cache

    @property
    def backend(self) -> GrammarBackend:
        """The backend, once built (waits for the build)."""
        return self._backend.result()

    def get(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (already resolved on a hit). A failure raises ValueError from it."""
        future = self._entries.get(spec)
        if future is not None:
            self._entries.move_to_end(spec)
            return future
        future = self._pool.submit(self._compile, spec)
        self._entries[spec] = future
        self._trim()
        return future

    def started_at(self, spec: GrammarSpec) -> float | None:
        """When the compile of `spec` began running (time.monotonic()); None while it waits for a worker."""
        return self._started.get(spec)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        self._started[spec] = time.monotonic()
        started = time.perf_counter()
        try:
            return self.backend.compile(spec)
        finally:
            self.compile_seconds.append(time.perf_counter() - started)

    def _trim(self) -> None:
        # Pending compilations stay: a waiting request holds their future.
        for spec in list(self._entries):
            if len(self._entries) <= self.max_entries:
                return
            if self._entries[spec].done():
                del self._entries[spec]
                self._started.pop(spec, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
