"""Prefill side: a request stops after its first token; its prompt's K/V stay held until the decode server that
claimed its room has them, written straight into the slots that server reserved."""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..scheduler.plugins.base import SchedulerHandle, SchedulerPlugin
from ..scheduler.req import Req
from ..wire.finish_reason import FinishReason
from .bootstrap import BootstrapServer, Claim, RoomRegistry
from .layout import KVLayout, kv_buffers, write_list
from .transfer import TransferError, make_agent


def prompt_digest(input_ids: list[int]) -> str:
    """Both sides must hold the same prompt, token for token (same tokenizer, same chat template)."""
    return hashlib.sha256(repr(input_ids).encode()).hexdigest()[:32]


@dataclass
class Held:
    req: Req
    deadline: float
    slots: list[int]  # the prompt's KV slots, position by position
    first_token: dict[str, Any]  # taken on the scheduler thread, which owns the request


class PrefillSender(SchedulerPlugin):
    """The prefill server's scheduler plug-in: every request stops after its first token, and its finished
    request's K/V are held until written to the decode server that claims its room."""

    def __init__(self, scheduler: SchedulerHandle) -> None:
        self.scheduler = scheduler
        args, runner = scheduler.args, scheduler.runner
        self.agent = make_agent(args.disaggregation_transfer_backend, args.disaggregation_host)
        self.agent.register(kv_buffers(runner.kv_pool))
        self.layout = KVLayout.of(runner.kv_pool)
        self.req_pool = runner.req_pool
        self.timeout = args.disaggregation_timeout
        self.registry = RoomRegistry()
        self.server = BootstrapServer(self.registry, args.disaggregation_host, args.disaggregation_bootstrap_port)
        # Writes block until the bytes landed; two let one request's transfer overlap the next one's set-up.
        self.writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="furcate-kv-send")
        self.held: dict[int, Held] = {}
        self.rooms: dict[int, int] = {}  # bootstrap_room -> id of the request holding it
        self.landed: queue.SimpleQueue[tuple[Req, str | None]] = queue.SimpleQueue()
        # kv_transfer_writes: (address, length) pieces; more per transfer when the slots are scattered.
        self.counters = {"kv_transfers": 0, "kv_transfer_bytes": 0, "kv_transfer_seconds": 0.0, "kv_transfer_writes": 0,
                      "kv_transfer_failures": 0}

    def close(self) -> None:
        self.writer.shutdown(wait=True, cancel_futures=True)

    @property
    def pending(self) -> bool:
        return bool(self.held)

    def holding(self) -> list[Req]:
        return [h.req for h in self.held.values()]

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)

    def take_new(self, req: Req) -> bool:
        req.params = dataclasses.replace(req.params, max_new_tokens=1)  # the decode server samples the rest
        return False

    def take_finished(self, req: Req) -> bool:
        self.hold(req)
        return True

    def advance(self) -> None:
        """Settle finished transfers: the prompt's K/V are intact either way, so they are cached."""
        for req, problem in self.poll():
            self.scheduler.memory.release(req)
            if problem is not None:
                self.scheduler.finish(req, FinishReason.peer_failure(problem))
            elif req.pending is not None:  # else it was aborted meanwhile and has been answered
                self.scheduler.finish(req, req.finish_reason)

    def hold(self, req: Req) -> None:
        """The request has its first token: keep its K/V until a decode server claimed and received them."""
        slots = self.req_pool.req_to_token[req.req_pool_idx, : len(req.input_ids)].tolist()
        held = self.held[id(req)] = Held(req, time.monotonic() + self.timeout, slots, first_token(req))
        room = req.bootstrap.room
        if room in self.rooms:  # a claim could not tell the two apart: the later one fails
            self.landed.put((req, f"bootstrap_room {room} is taken by a request still waiting for its decode server"))
            return
        self.rooms[room] = id(req)
        self.registry.expect(room, lambda claim: self.writer.submit(self._send, held, claim))

    def poll(self) -> list[tuple[Req, str | None]]:
        """Requests whose K/V went out (None) or could not (the reason); their slots may be released now."""
        out = []
        while not self.landed.empty():
            req, problem = self.landed.get()
            if self.held.pop(id(req), None) is not None:
                out.append((req, problem))
        now = time.monotonic()
        for key, held in list(self.held.items()):
            if now > held.deadline and self.rooms.get(held.req.bootstrap.room) == key and \
                    self.registry.forget(held.req.bootstrap.room):
                del self.held[key]
                out.append((held.req, f"no decode server claimed bootstrap_room {held.req.bootstrap.room} within "
                                      f"{self.timeout:g} s"))
        for req, _ in out:
            if self.rooms.get(req.bootstrap.room) == id(req):
                del self.rooms[req.bootstrap.room]
        return out

    def _send(self, held: Held, claim: Claim) -> None:
        req, room = held.req, held.req.bootstrap.room
        if not self.registry.begin_write(claim):
            self.landed.put((req, f"the decode server withdrew its claim on bootstrap_room {room}"))
            return
        try:
            problem = self._write(held, claim.destination)
        except Exception as error:  # noqa: BLE001 - a failed transfer fails its request, never the scheduler
            problem = f"KV transfer failed: {type(error).__name__}: {error}"
        if problem is None:
            self.registry.settle(room, claim, held.first_token)
        else:
            self.counters["kv_transfer_failures"] += 1
            self.registry.settle(room, claim, {"error": problem})
        self.landed.put((req, problem))

    def _write(self, held: Held, destination: dict[str, Any]) -> str | None:
        peer = KVLayout.from_json(destination["layout"])
        if (mismatch := self.layout.mismatch(peer)) is not None:
            return mismatch
        if destination["digest"] != prompt_digest(held.req.input_ids):
            return "the prefill and decode servers tokenized the prompt differently; run both with one tokenizer"
        start, slots = int(destination["start"]), [int(s) for s in destination["slots"]]
        if not 0 <= start <= len(held.slots) or start + len(slots) != len(held.slots):
            return "the decode server reserved slots for a different prompt length"
        if any(not 0 < s < peer.num_slots for s in slots):
            return "the decode server named KV slots outside its pool"
        sources, destinations, lengths = write_list(self.layout, peer, held.slots[start:], slots)
        began = time.perf_counter()
        try:
            self.agent.write(str(destination["session"]), sources, destinations, lengths)
        except TransferError as error:
            return str(error)
        self.counters["kv_transfers"] += 1
        self.counters["kv_transfer_bytes"] += sum(lengths)
        self.counters["kv_transfer_writes"] += len(lengths)
        self.counters["kv_transfer_seconds"] += time.perf_counter() - began
        return None


def first_token(req: Req) -> dict[str, Any]:
    """What the decode server continues from: the token this side sampled, with its logprobs when asked."""
    out = req.output()
    return {
        "first_token": req.output_ids[0],
        "logprob": out.output_logprobs[0] if out.output_logprobs else None,
        "top": out.output_top_logprobs[0] if out.output_top_logprobs else None,
    }
