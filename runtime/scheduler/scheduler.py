"""The scheduler process: receives tokenized requests, batches them, runs the model, streams results back.

The loop is three calls: take new messages, step (schedule a batch and hand it to the launcher), send what it
produced. The plain and overlapped loops differ only in their launcher (launchers.py).
"""

from __future__ import annotations

import logging
import random
from multiprocessing.connection import Connection
from typing import Any

from transformers import AutoTokenizer

from ..cache.chunk_cache import ChunkCache
from ..cache.radix_cache import RadixCache
from ..config import EngineArgs
from ..distributed.spawn import Spawned
from ..executor.batch import ReqSlice, ScheduleBatch, build_batch
from ..executor.model_runner import ModelRunner, SamplingInputs, StepResult
from ..wire.control_calls import Shutdown
from ..wire.finish_reason import FinishReason
from ..wire.messages import AbortReq, LoadReport, ReqOutput, RpcOut, RpcReq, SchedulerReady, TokenizedGenerateReq
from .assembly import build_plugins, control_calls
from .launchers import OverlapLauncher, PlainLauncher, VerifyingLauncher
from .memory import MemoryManager
from .plugins.jump_forward import forced_tokens
from .plugins.speculation import Speculator, step_tokens
from .policy import order_waiting
from .prefill_adder import PrefillAdder
from .req import Req
from .stats import scheduler_handlers, stats

logger = logging.getLogger("furcate.scheduler")


class Scheduler:
    """Owns the request queues and the loop; plug-ins (plugins/) hold requests outside its queues and reach it
    through the handle it is to them (plugins/base.py SchedulerHandle)."""

    def __init__(self, args: EngineArgs, model_path: str, tokenizer_path: str, conn: Connection,
                 followers: Spawned | None = None) -> None:
        self.args = args
        self.conn = conn
        self.runner = ModelRunner(args, model_path, spawned=followers)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.eos_ids = eos_token_ids(self.runner.config, self.tokenizer)
        self.max_req_len = min(self.runner.context_length, self.runner.max_total_tokens)
        cache_type = ChunkCache if args.disable_radix_cache else RadixCache
        self.cache = cache_type(self.runner.req_pool, self.runner.kv_pool)
        self.memory = MemoryManager(args, self.cache, self.runner.req_pool, self.runner.kv_pool)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        plugins = build_plugins(self, tokenizer_path, self.eos_ids)
        self.plugins, self.grammars, self.weights = plugins.ordered, plugins.grammars, plugins.weights
        self.rpc = control_calls(scheduler_handlers(self), self.plugins)
        self.chunked_req: Req | None = None
        self.last_batch_prefilled = False
        self.rng = random.Random(args.random_seed)
        self.launcher = self._launcher(plugins.speculator)
        self.outputs: list[Any] = []
        self.reported: dict[str, Any] | None = None  # the counters last sent in a LoadReport
        self.cached_tokens_total = 0
        self.jumped_tokens = 0
        self.prompt_tokens_total = 0

    def _launcher(self, speculator: Speculator | None) -> PlainLauncher:
        """Where batches run: the overlap loop's launcher, the plain one, or under speculative decoding the plain
        one that verifies drafts (the overlap loop carries one token in flight per request, a verify step several)."""
        parts = (self.runner, self.process_result, self.sampling_inputs)
        if speculator is not None:
            return VerifyingLauncher(speculator.run, *parts)
        return (PlainLauncher if self.args.disable_overlap_schedule else OverlapLauncher)(*parts)

    def ready_message(self) -> SchedulerReady:
        return SchedulerReady(
            max_total_tokens=self.runner.max_total_tokens,
            max_req_len=self.max_req_len,
            context_length=self.runner.context_length,
            vocab_size=self.runner.vocab_size,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            quantized_layers=len(self.runner.quantized.layers),
            quantized_max_rows=self.runner.quantized.max_rows,
            disaggregation_mode=self.args.disaggregation_mode,
            tp_size=self.runner.tp.size,
            load=stats(self),
        )

    @property
    def has_work(self) -> bool:
        """Something can be computed now (requests still compiling their grammar cannot)."""
        return bool(self.waiting or self.running or self.chunked_req)

    @property
    def held(self) -> bool:
        """Nothing may be scheduled: generation is paused, or the weights or K/V memory are released."""
        return any(plugin.blocks_forwards for plugin in self.plugins)

    @property
    def idle(self) -> bool:
        return not (self.has_work or self.plugins_pending)

    @property
    def plugins_pending(self) -> bool:
        return any(plugin.pending for plugin in self.plugins)

    # -- the loop -------------------------------------------------------------------------------------------

    def event_loop(self) -> None:
        try:
            while self.receive_messages(block=not (self.has_work and not self.held or self.launcher.busy)):
                self.send_outputs()  # control answers now, not after the step: a prefill chunk can take seconds
                self.step()
                self.report_load()
                self.send_outputs()
        finally:
            self.launcher.close()
            for plugin in self.plugins:
                plugin.close()

    def step(self) -> None:
        """Schedule the next batch and hand it to the launcher, which folds in (process_result) every batch whose
        tokens are known by the end of the round."""
        if self.launcher.busy and self.memory.room() < len(self.running):
            self.launcher.drain()  # retraction must see every sampled token
        self.launcher.submit(None if self.held else self.next_batch())

    def receive_messages(self, block: bool) -> bool:
        """Handle everything the engine sent; False once it asked to shut down."""
        # Requests waiting only on a plug-in (a grammar, a KV transfer) must not block the loop: poll until they settle.
        polling = self.plugins_pending or bool(self.rpc.deferred)
        for message in receive(self.conn, block=block, timeout=0.002 if polling else None):
            if isinstance(message, RpcReq) and isinstance(message.call, Shutdown):
                self.conn.send([RpcOut(message.call_id, True)])
                return False
            self.handle(message)
        for plugin in self.plugins:
            plugin.advance()
        self.outputs += self.rpc.advance()
        return True

    def report_load(self) -> None:
        """The counters after this step, ahead of its outputs (a caller that sees its request end sees the load
        without it), when they changed."""
        counters = stats(self)
        if counters != self.reported:
            self.outputs.insert(0, LoadReport(counters))
            self.reported = counters

    def send_outputs(self) -> None:
        if self.outputs:
            for out in self.outputs:
                if isinstance(out, ReqOutput):
                    out.weight_version = self.weights.version
            self.conn.send(self.outputs)
            self.outputs = []

    def sampling_inputs(self, batch: ScheduleBatch) -> SamplingInputs:
        """Snapshot of what sampling needs (penalty history, seeds, grammar masks), taken on this thread."""
        reqs = [piece.req for piece in batch.slices if piece.samples]
        bitmask, constrained = self.grammars.fill_masks(reqs, self.runner.vocab_size)
        return SamplingInputs([req.sampling_row() for req in reqs], bitmask, constrained)

    # -- messages -------------------------------------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, TokenizedGenerateReq):
            self.accept(message)
        elif isinstance(message, AbortReq):
            self.abort(message.rid)
        elif isinstance(message, RpcReq):
            if (answer := self.rpc.answer(message)) is not None:
                self.outputs.append(answer)
        else:
            raise TypeError(f"scheduler got an unknown message {type(message).__name__}")

    def accept(self, message: TokenizedGenerateReq) -> None:
        """Queue a new request; one that cannot even be queued fails alone, the loop keeps going."""
        try:
            req = Req.from_tokenized(message, self.rng.randrange(2**31), self.eos_ids)
        except Exception as error:  # noqa: BLE001 - a malformed request is answered, never allowed to stop the loop
            self.outputs.append(ReqOutput(rid=message.rid, new_token_ids=[], finish_reason=FinishReason.internal_error(
                f"request could not be queued: {type(error).__name__}: {error}")))
            return
        if not any(plugin.take_new(req) for plugin in self.plugins):
            self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """A request ready to run, unless a plug-in holds it first (a decode server's prompt K/V come over)."""
        if not any(plugin.take_ready(req) for plugin in self.plugins):
            self.waiting.append(req)

    def abort(self, rid: str, reason: FinishReason | None = None) -> None:
        reason = reason or FinishReason.abort("aborted by request")
        for plugin in self.plugins:
            for req in plugin.remove(rid):
                self.finish(req, reason)
            for req in plugin.holding():
                if req.rid == rid and not req.finished:  # its memory is released when the plug-in settles it
                    self.finish(req, reason)
        matches = [r for r in self.waiting + self.running + [self.chunked_req] if r is not None and r.rid == rid]
        for req in matches:
            if req in self.waiting:
                self.waiting.remove(req)
            else:
                self.memory.release(req)
            self.running = [r for r in self.running if r is not req]
            if self.chunked_req is req:
                self.chunked_req = None
            self.finish(req, reason)

    # -- batching -------------------------------------------------------------------------------------------

    def next_batch(self) -> ScheduleBatch | None:
        # Without mixed batches, a long chunked prefill alternates with decode steps so decoding never stalls.
        yield_to_decode = (self.chunked_req is not None and self.last_batch_prefilled and self.running
                           and not self.args.enable_mixed_chunk)
        slices = [] if yield_to_decode else self.admit()
        self.last_batch_prefilled = bool(slices)
        if not slices or self.args.enable_mixed_chunk:
            self.memory.make_decode_room(self.running, self.retract)
            decoding = [ReqSlice.next_of(req, unseen=self.launcher.unseen(req)) for req in self.running]
            if not slices:  # drafts ride in pure decode batches only
                room = self.draft_room(decoding)
                for plugin in self.plugins:
                    plugin.shape_decode(decoding, room)
            slices += decoding
        if not slices:
            return None
        batch = build_batch(slices, self.runner.req_pool, self.runner.kv_pool, self.memory.alloc)
        running = {id(r) for r in self.running}
        for piece in slices:
            if id(piece.req) not in running:
                # Shareable at once: batches run in order, so any later reader finds this K/V written.
                self.cache.cache_unfinished_req(piece.req)
        return batch

    def draft_room(self, decoding: list[ReqSlice]) -> int:
        """KV slots drafts may take: what is left once each decode slice has its slot and the prompt being prefilled
        in chunks has room for its next chunk (tokens accepted now must not eat the room it was admitted with)."""
        chunk = 0
        if self.chunked_req is not None:
            chunk = min(len(self.chunked_req.fill_ids) - self.chunked_req.kv_len, self.args.chunked_prefill_size)
        return self.memory.room() - len(decoding) - chunk

    def admit(self) -> list[ReqSlice]:
        if not self.waiting and self.chunked_req is None:
            return []
        adder = PrefillAdder(self.cache, self.runner.req_pool, self.runner.kv_pool, self.running,
                             self.memory.new_token_ratio, self.args.max_prefill_tokens,
                             self.args.chunked_prefill_size, self.args.max_running_requests)
        decoding_too = len(self.running) if self.args.enable_mixed_chunk else 0
        if self.chunked_req is not None and not adder.add_chunked(self.chunked_req, decoding_too):
            return []  # no room for any of its next chunk yet; it stays the chunked request
        for req in self.waiting:
            self.match_prefix(req)
        root = self.cache.root if isinstance(self.cache, RadixCache) else None
        check_sharing = root is not None and self.args.schedule_policy in ("lpm", "dfs-weight")
        for req in order_waiting(self.waiting, self.args.schedule_policy, self.rng, root):
            if adder.chunked_req is not None:
                break  # one chunked prompt at a time
            if not adder.add(req, check_sharing):
                break
        admitted = {id(p.req) for p in adder.slices}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        # Decided now, not when results arrive: the overlap loop schedules the next batch before that.
        self.chunked_req = adder.chunked_req
        return adder.slices

    def match_prefix(self, req: Req) -> None:
        """Match the longest cached prefix, leaving at least one token to compute (its logits pick the next
        token) and every prompt position whose logprob was asked for."""
        fill = req.fill_ids
        limit = len(fill) - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(req.input_logprob_start, 1) - 1)
        match = self.cache.match_prefix(fill[:limit])
        req.prefix_indices, req.last_node = match.indices, match.last_node

    def retract(self, req: Req) -> None:
        """Give up a running request's KV (cached where possible) and put it back at the head of the queue."""
        self.running.remove(req)
        self.memory.release(req)
        self.waiting.insert(0, req)

    # -- the handle's verbs (plugins/base.py SchedulerHandle) ----------------------------------------------------

    def drain(self) -> None:
        self.launcher.drain()

    def live_requests(self) -> list[Req]:
        return [req for req in self.waiting + self.running + [self.chunked_req] if req is not None]

    def kv_holders(self) -> int:
        return len(self.running) + (self.chunked_req is not None)

    def held_requests(self) -> list[Req]:
        return [req for plugin in self.plugins for req in plugin.holding()]

    def retract_all(self) -> None:
        for req in list(self.running):
            self.retract(req)
        if self.chunked_req is not None:  # a prompt half prefilled: it restarts from what the cache keeps
            req, self.chunked_req = self.chunked_req, None
            self.memory.release(req)
            self.waiting.insert(0, req)

    # -- results --------------------------------------------------------------------------------------------

    def process_result(self, batch: ScheduleBatch, result: StepResult) -> None:
        """Fold a batch's tokens into its requests."""
        running = {id(r) for r in self.running}
        for b, piece in enumerate(batch.slices):
            req = piece.req
            if b in result.input_logprobs:
                req.input_logprob_values.extend(result.input_logprobs[b])
                req.input_top_values.extend(result.input_top.get(b, []))
            if not piece.samples:  # a chunk of a long prompt; the next one follows next step
                continue
            if b not in result.next_ids or req.finished:  # dropped as stale, or finished while this batch ran
                continue
            if id(req) not in running:
                self.finish_prefill(req)
                if req.finished:
                    continue
            self.take_step_tokens(req, piece, step_tokens(result, b))
            jumped = not req.finished and not self.args.disable_jump_forward and self.jump_forward(req)
            if jumped:  # a batch launched meanwhile (overlap loop) samples for the state before the jump
                self.launcher.redirect(req)
            if req.finished:
                if not any(plugin.take_finished(req) for plugin in self.plugins):
                    self.memory.release(req)
                    self.finish(req, req.finish_reason)
            elif id(req) not in running:
                self.running.append(req)
        self.running = [r for r in self.running if not r.finished]
        self.waiting = [r for r in self.waiting if not r.finished]
        for req in self.running:
            if (out := req.output_due()) is not None:
                self.outputs.append(out)

    def take_step_tokens(self, req: Req, piece: ReqSlice, tokens: list) -> None:
        """One token, or a verify step's accepted drafts and the one after, up to where the request stops."""
        taken = 0
        for token, logprob, top in tokens:
            self.take_token(req, token, logprob, top)
            taken += 1
            if req.finished:
                break
        for plugin in self.plugins:
            plugin.tokens_taken(req, piece, len(tokens), taken)

    def take_token(self, req: Req, token: int, logprob: float | None, top: list | None) -> None:
        req.append_token(token, self.decode_tail, self.runner.context_length)
        out = req.output()
        if logprob is not None:
            out.output_logprobs.append(logprob)
            out.output_top_logprobs.append(top)
        if req.matcher is None:
            return
        if not req.matcher.accept(token):
            req.finish_reason = FinishReason.internal_error(f"the grammar rejected token {token}")
        elif req.matcher.is_terminated() and not req.finished:
            req.finish_reason = FinishReason.stop_token(token)

    def jump_forward(self, req: Req) -> bool:
        """Append the tokens the grammar forces next (which ones: jump_forward.py); the next step's extend computes
        them. True when tokens were appended."""
        if req.matcher is None or req.return_logprob:  # jumped tokens have no sampled logprob to report
            return False
        try:
            forced = req.matcher.jump_forward()
        except Exception as error:  # noqa: BLE001 - jump-forward only saves steps; the request decodes on without it
            logger.warning("request %s: the grammar's jump-forward failed, decoding on without it: %s: %s",
                           req.rid, type(error).__name__, error)
            return False
        if not forced:
            return False
        taken = 0
        # The request must still sample after a jump: jumped tokens never use up max_new_tokens.
        for token in forced_tokens(self.tokenizer, forced, req.remaining_output - 1):
            if req.finished or not req.matcher.accept(token):
                break
            req.append_token(token, self.decode_tail, self.runner.context_length)
            taken += 1
        self.jumped_tokens += taken
        return taken > 0

    def finish_prefill(self, req: Req) -> None:
        """First time a request reaches the end of its prompt: report prompt facts, cache the prompt."""
        out = req.output()
        if not req.output_ids:  # a retracted request resuming has reported these already
            out.prompt_tokens = len(req.input_ids)
            out.cached_tokens = req.cached_tokens
            self.prompt_tokens_total += len(req.input_ids)
            self.cached_tokens_total += req.cached_tokens
        if req.wants_input_logprobs:
            start = req.input_logprob_start
            out.input_logprob_start = start
            out.input_logprobs = ([None] if start == 0 else []) + req.input_logprob_values
            if req.top_logprobs_num > 0:
                out.input_top_logprobs = ([None] if start == 0 else []) + req.input_top_values
            req.input_logprobs_sent = True
        if req.params.max_new_tokens == 0:
            self.memory.release(req)
            self.finish(req, FinishReason.length(0))

    def start_decoding(self, req: Req, token: int, logprob: float | None, top: list | None) -> None:
        """A request whose prompt K/V were computed elsewhere (a prefill server) joins the running batch."""
        self.cache.cache_unfinished_req(req)
        self.finish_prefill(req)
        self.take_token(req, token, logprob, top)
        if req.finished:
            self.memory.release(req)
            self.finish(req, req.finish_reason)
            return
        self.running.append(req)
        if (out := req.output_due()) is not None:  # the first token goes out now, not with the next step's
            self.outputs.append(out)

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        out = req.output()
        out.finish_reason = reason
        self.outputs.append(out)
        req.pending = None

    def decode_tail(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def receive(conn: Connection, block: bool, timeout: float | None = None) -> list[Any]:
    """Everything the engine has sent; when blocking, waits (up to `timeout`) for a first message."""
    messages = []
    if conn.poll(timeout) if block else conn.poll():
        messages.append(conn.recv())
    while conn.poll():
        messages.append(conn.recv())
    return messages


def eos_token_ids(config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)
