"""The scheduler process: receives tokenized requests, batches them, runs the model, streams results back.

The loop is three calls: take new messages, build and run the next batch, send what it produced.
"""

from __future__ import annotations

import logging
import random
from multiprocessing.connection import Connection
from typing import Any

from transformers import AutoTokenizer

from ..config import EngineArgs
from ..io import AbortReq, ReqOutput, RpcOut, RpcReq, SchedulerReady, TokenizedGenerateReq
from .batch import ScheduleBatch, build_decode, build_prefill, release
from .model_runner import ModelRunner, StepResult
from .policy import order_waiting
from .req import Req

logger = logging.getLogger("furcate.scheduler")


class Scheduler:
    def __init__(self, args: EngineArgs, model_path: str, tokenizer_path: str, conn: Connection) -> None:
        self.args = args
        self.conn = conn
        self.runner = ModelRunner(args, model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.eos_ids = eos_token_ids(self.runner.config, self.tokenizer)
        self.max_req_len = min(self.runner.context_length, self.runner.max_total_tokens)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.rng = random.Random(args.random_seed)
        self.outputs: list[ReqOutput] = []

    def ready_message(self) -> SchedulerReady:
        return SchedulerReady(
            max_total_tokens=self.runner.max_total_tokens,
            max_req_len=self.max_req_len,
            context_length=self.runner.context_length,
            vocab_size=self.runner.vocab_size,
        )

    # -- the loop -------------------------------------------------------------------------------------------

    def event_loop(self) -> None:
        while True:
            for message in receive(self.conn, block=not (self.waiting or self.running)):
                if isinstance(message, RpcReq) and message.method == "shutdown":
                    self.conn.send([RpcOut(message.call_id, True)])
                    return
                self.handle(message)
            self.step()

    def step(self) -> None:
        batch = self.next_batch()
        if batch is not None:
            self.process_result(batch, self.runner.run(batch))
        if self.outputs:
            self.conn.send(self.outputs)
            self.outputs = []

    # -- messages -------------------------------------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, TokenizedGenerateReq):
            seed = self.rng.randrange(2**31)
            self.waiting.append(Req.from_tokenized(message, seed, self.eos_ids))
        elif isinstance(message, AbortReq):
            self.abort(message.rid)
        elif isinstance(message, RpcReq):
            self.outputs.append(RpcOut(message.call_id, getattr(self, f"rpc_{message.method}")()))
        else:
            raise TypeError(f"scheduler got an unknown message {type(message).__name__}")

    def abort(self, rid: str) -> None:
        for queue_ in (self.waiting, self.running):
            for req in [r for r in queue_ if r.rid == rid]:
                queue_.remove(req)
                release(req, self.runner.req_pool, self.runner.kv_pool)
                req.finish_reason = {"type": "abort", "message": "aborted by request"}
                req.output().finish_reason = req.finish_reason
                self.outputs.append(req.output())

    def rpc_get_stats(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "forward_seconds": runner.forward_seconds,
            "forward_calls": runner.forward_calls,
            "kv_available": runner.kv_pool.available_size(),
            "max_total_tokens": runner.max_total_tokens,
            "req_slots_available": runner.req_pool.available_size(),
            "max_running_requests": self.args.max_running_requests,
            "running": len(self.running),
            "waiting": len(self.waiting),
        }

    def rpc_flush_cache(self) -> bool:
        """With no prefix cache, nothing outlives its request: flushing succeeds whenever the engine is idle."""
        return not (self.waiting or self.running)

    # -- batching -------------------------------------------------------------------------------------------

    def next_batch(self) -> ScheduleBatch | None:
        admitted = self.admit()
        if admitted:
            return build_prefill(admitted, self.runner.req_pool, self.runner.kv_pool)
        if self.running:
            return build_decode(self.running, self.runner.req_pool, self.runner.kv_pool)
        return None

    def admit(self) -> list[Req]:
        """Admit waiting requests in policy order while their whole prompt and output fit in free KV memory.

        Every running request keeps a reservation for the rest of its output, so decode never runs out of slots.
        """
        if not self.waiting:
            return []
        reserved = sum(r.max_tokens_needed - r.kv_len for r in self.running)
        free = self.runner.kv_pool.available_size() - reserved
        slots = min(self.runner.req_pool.available_size(), self.args.max_running_requests - len(self.running))
        admitted: list[Req] = []
        prefill_tokens = 0
        for req in order_waiting(self.waiting, self.args.schedule_policy, self.rng):
            too_many_tokens = admitted and prefill_tokens + len(req.input_ids) > self.args.max_prefill_tokens
            if len(admitted) >= slots or req.max_tokens_needed > free or too_many_tokens:
                break
            admitted.append(req)
            free -= req.max_tokens_needed
            prefill_tokens += len(req.input_ids)
        for req in admitted:
            self.waiting.remove(req)
        return admitted

    # -- results --------------------------------------------------------------------------------------------

    def process_result(self, batch: ScheduleBatch, result: StepResult) -> None:
        for b, req in enumerate(batch.reqs):
            out = req.output()
            if batch.is_prefill:
                out.prompt_tokens = len(req.input_ids)
                out.input_logprobs = result.input_logprobs.get(b)
                out.input_top_logprobs = result.input_top.get(b)
                out.input_logprob_start = req.input_logprob_start
            if batch.is_prefill and req.params.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
            else:
                req.append_token(result.next_ids[b], self.decode_tail, self.runner.context_length)
                if b in result.output_logprobs:
                    out.output_logprobs.append(result.output_logprobs[b])
                    out.output_top_logprobs.append(result.output_top[b])
            if req.finished:
                out.finish_reason = req.finish_reason
                release(req, self.runner.req_pool, self.runner.kv_pool)
            elif batch.is_prefill:
                self.running.append(req)
            self.outputs.append(out)
            req.pending = None
        self.running = [r for r in self.running if not r.finished]

    def decode_tail(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def receive(conn: Connection, block: bool) -> list[Any]:
    """Everything the engine has sent; waits for the first message only when there is nothing to compute."""
    messages = []
    if block or conn.poll():
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
