"""Decode side: a request reserves KV slots for its prompt (less what its own prefix cache holds), claims its
room at the prefill server's bootstrap service, and joins the running batch once its K/V and first token came."""

from __future__ import annotations

import queue
from typing import Any

import aiohttp

from ..scheduler.memory import reserved_output
from ..scheduler.plugins.base import SchedulerHandle, SchedulerPlugin
from ..scheduler.req import EMPTY_SLOTS, Req
from ..wire.finish_reason import FinishReason
from .bootstrap import LoopThread, claim_room
from .layout import KVLayout, kv_buffers
from .prefill import prompt_digest
from .transfer import make_agent


class DecodeReceiver(SchedulerPlugin):
    """The decode server's scheduler plug-in: a ready request waits here until its prompt's K/V and first token
    arrived from the prefill server, then joins the running batch."""

    def __init__(self, scheduler: SchedulerHandle) -> None:
        self.scheduler = scheduler
        args, runner = scheduler.args, scheduler.runner
        self.agent = make_agent(args.disaggregation_transfer_backend, args.disaggregation_host)
        self.agent.register(kv_buffers(runner.kv_pool))
        self.layout = KVLayout.of(runner.kv_pool)
        self.req_pool, self.kv_pool = runner.req_pool, runner.kv_pool
        self.cache, self.memory = scheduler.cache, scheduler.memory
        self.timeout = args.disaggregation_timeout
        self.max_running = args.max_running_requests
        self.loop = LoopThread("furcate-kv-receive")
        self.session: aiohttp.ClientSession = self.loop.submit(_new_session()).result()
        self.queued: list[Req] = []  # waiting for KV slots
        self.receiving: dict[int, Req] = {}  # slots reserved, room claimed, K/V on the way
        self.landed: queue.SimpleQueue[tuple[Req, dict[str, Any]]] = queue.SimpleQueue()

    def close(self) -> None:
        self.loop.submit(self.session.close()).result(timeout=10)

    @property
    def pending(self) -> bool:
        return bool(self.queued or self.receiving)

    def holding(self) -> list[Req]:
        return list(self.receiving.values())

    def take_ready(self, req: Req) -> bool:
        self.queued.append(req)
        return True

    def advance(self) -> None:
        for req, outcome in self.poll():
            self.land(req, outcome)
        self.start_queued(self.scheduler.running, self.memory.new_token_ratio)

    def land(self, req: Req, outcome: dict[str, Any]) -> None:
        """The prompt's K/V arrived with the first token (or the transfer failed)."""
        token = outcome.get("first_token")
        vocab = self.scheduler.runner.vocab_size
        valid = (isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab
                 and isinstance(outcome.get("logprob"), (int, float, type(None)))
                 and isinstance(outcome.get("top"), (list, type(None))))
        if "error" in outcome or not valid:
            self.discard(req)  # what those slots hold is not this prompt's K/V
            if not req.finished:
                self.scheduler.finish(req, FinishReason.peer_failure(
                    f"prefill/decode KV transfer failed: {outcome.get('error', outcome)}"))
        elif req.finished:  # aborted while its K/V were on the way; they are good, so cache them
            self.memory.release(req)
        else:
            self.scheduler.start_decoding(req, token, outcome.get("logprob"), outcome.get("top"))

    def remove(self, rid: str) -> list[Req]:
        matches = [r for r in self.queued if r.rid == rid]
        self.queued = [r for r in self.queued if r.rid != rid]
        return matches

    def start_queued(self, running: list[Req], new_token_ratio: float) -> None:
        """Reserve slots and claim rooms for queued requests, first come first served, while memory lasts
        (the same budget admission keeps: room for every running request's reserved output)."""
        reserved = sum(reserved_output(r, new_token_ratio) for r in running + self.holding())
        while self.queued and len(running) + len(self.receiving) < self.max_running and self.req_pool.available_size():
            req = self.queued[0]
            match = self.cache.match_prefix(req.input_ids)
            need = len(req.input_ids) - len(match.indices) + reserved_output(req, new_token_ratio)
            if need > self.memory.room() - reserved:
                return
            self.queued.pop(0)
            reserved += need
            self._reserve(req, match)
            self.receiving[id(req)] = req
            self.loop.submit(self._claim(req, self._destination(req)))

    def _reserve(self, req: Req, match) -> None:
        self.cache.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.indices, match.last_node
        req.req_pool_idx = self.req_pool.alloc()
        prefix = len(match.indices)
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[:prefix] = match.indices
        row[prefix : len(req.input_ids)] = self.memory.alloc(len(req.input_ids) - prefix)
        req.kv_len = len(req.input_ids)  # true once the transfer lands; until then nothing reads these slots
        req.cached_tokens = prefix

    def _destination(self, req: Req) -> dict[str, Any]:
        """Where the prefill server must write: taken on the scheduler thread, which owns the request table."""
        start = len(req.prefix_indices)
        slots = self.req_pool.req_to_token[req.req_pool_idx, start : len(req.input_ids)].tolist()
        return {"session": self.agent.session_id, "layout": self.layout.to_json(), "start": start, "slots": slots,
                "digest": prompt_digest(req.input_ids)}

    async def _claim(self, req: Req, destination: dict[str, Any]) -> None:
        boot = req.bootstrap
        outcome = await claim_room(self.session, boot.host, boot.port, boot.room, destination, self.timeout)
        self.landed.put((req, outcome))

    def poll(self) -> list[tuple[Req, dict[str, Any]]]:
        """Requests whose claim settled: {"first_token", "logprob", "top"} or {"error"}."""
        out = []
        while not self.landed.empty():
            req, outcome = self.landed.get()
            if self.receiving.pop(id(req), None) is not None:
                out.append((req, outcome))
        return out

    def discard(self, req: Req) -> None:
        """Free a request's reserved slots without caching them: their contents never arrived."""
        prefix = len(req.prefix_indices)
        self.kv_pool.free(self.req_pool.req_to_token[req.req_pool_idx, prefix : req.kv_len].clone())
        self.cache.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len = None, 0
        req.prefix_indices, req.last_node = EMPTY_SLOTS, None


async def _new_session() -> aiohttp.ClientSession:
    # One connection per claim in flight: each waits for its own transfer.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
