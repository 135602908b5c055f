"""Engine: the in-process entry point. Tokenizes, validates, talks to the scheduler process, detokenizes.

The model never runs on the caller's thread: the scheduler lives in a spawned process, and a receiver thread
folds its outputs into per-request state that sync and async callers wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Unpack, overload

from transformers import AutoTokenizer

from ..config import EngineArgs
from ..model.weights.checkpoint import check_tp_size, checkpoint_vision_spec, load_config, resolve_model_path
from ..multimodal.images import ImageLimits
from ..multimodal.prompt import ImagePrompts
from ..speculative.draft_check import prepare_draft_model
from ..wire.control_calls import CheckIntegrity, FlushCache, GetStats, Shutdown
from ..wire.messages import TokenizedGenerateReq
from .generate_request import (
    AsyncChunks,
    BootstrapFields,
    Chunks,
    GenerateOptions,
    GenerateRequest,
    Output,
    SamplingArg,
    bootstrap_of,
)
from .launch import start_scheduler_process, started_one
from .link import SchedulerLink
from .outbox import QueueFullError
from .request_builder import RequestBuilder
from .request_state import RequestState
from .rl import EngineRl
from .schema_check import SchemaChecker

STARTUP_TIMEOUT_S = 600


class _Reader:
    """The one way a caller reads a request's sink, sync or async, streamed or whole: an error item is raised, the
    item with a finish_reason is the last, and leaving the reader before that abandons (aborts) the request."""

    def __init__(self, state: RequestState, abandon: Callable[[RequestState], None]) -> None:
        self.state = state
        self.abandon = abandon
        self.done = False

    def take(self, item: Output | Exception) -> Output:
        if isinstance(item, Exception):
            raise item
        self.done = item["meta_info"]["finish_reason"] is not None
        return item

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.state.finished:  # closed early, cancelled or timed out: nobody waits any more
            self.abandon(self.state)

    def chunks(self, get: Callable[[], Output | Exception]) -> Chunks:
        with self:
            while not self.done:
                yield self.take(get())

    async def async_chunks(self, get: Callable[[], Awaitable[Output | Exception]]) -> AsyncChunks:
        with self:  # the same loop as chunks(), awaiting each item
            while not self.done:
                yield self.take(await get())


def image_prompts(model_path: str, args: EngineArgs, vocab_size: int) -> ImagePrompts | None:
    """A vision-language model's image processing on this side; None for a text-only model."""
    spec = checkpoint_vision_spec(model_path)
    if spec is None:
        return None
    limits = ImageLimits(max_pixels=args.max_image_pixels, max_images=args.max_images_per_request,
                         allow_remote=args.allow_remote_images)
    return ImagePrompts(model_path, spec, vocab_size, limits)


class Engine(EngineRl):
    """`Engine(model_path="default", **engine_args)`; see EngineArgs for the arguments. The RL calls (weight
    updates, memory release, pause) are in rl.py."""

    def __init__(self, model_path: str = "default", **kwargs: Any) -> None:
        self.args = EngineArgs(model_path=model_path, **kwargs)
        self.model_path = resolve_model_path(self.args.model_path)
        if self.args.tp_size > 1:  # a model that cannot be split fails here, before any process starts
            check_tp_size(load_config(self.model_path), self.args.tp_size)
        self.args = prepare_draft_model(self.args, self.model_path)  # STANDALONE: a bad draft model fails here
        self.tokenizer_path = self.args.tokenizer_path or self.model_path
        self._process, conn = start_scheduler_process()
        self._link = SchedulerLink(self._process, conn, self.args.max_pending_requests)
        conn.send((self.args, self.model_path, self.tokenizer_path))
        try:  # the tokenizer loads here while the scheduler process imports torch
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self.info = self._link.wait_ready(STARTUP_TIMEOUT_S)
        except BaseException:
            self._process.kill()
            self._process.wait()
            raise
        started_one()
        self.builder = RequestBuilder(self.tokenizer, self.info, image_prompts(self.model_path, self.args,
                                                                               self.info.vocab_size))
        self.schema_checker = SchemaChecker()  # validates finished json_schema outputs on the receiver thread
        # Called (on the receiver thread) with each request's RequestState when it ends: the server's metrics.
        self.request_observers: list[Callable[[RequestState], None]] = self._link.observers
        self._link.start()

    # -- public API ---------------------------------------------------------------------------------------

    @overload
    def generate(self, prompt: str | None = None, sampling_params: SamplingArg = None,
                 input_ids: list[int] | None = None, *, stream: Literal[True],
                 **options: Unpack[GenerateOptions]) -> Chunks: ...

    @overload
    def generate(self, prompt: list[str] | None = None, sampling_params: SamplingArg = None,
                 input_ids: list[list[int]] | None = None, *, stream: Literal[False] = False,
                 **options: Unpack[GenerateOptions]) -> list[Output]: ...

    @overload
    def generate(self, prompt: str | None = None, sampling_params: SamplingArg = None,
                 input_ids: list[int] | None = None, *, stream: Literal[False] = False,
                 **options: Unpack[GenerateOptions]) -> Output | list[Output]: ...

    @overload
    def generate(self, prompt: str | list[str] | None = None, sampling_params: SamplingArg = None,
                 input_ids: list[int] | list[list[int]] | None = None, *, stream: bool = False,
                 **options: Unpack[GenerateOptions]) -> Output | list[Output] | Chunks: ...

    def generate(self, prompt: str | list[str] | None = None, sampling_params: SamplingArg = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 stream: bool = False, rid: str | None = None, timeout: float | None = None, image_data: Any = None,
                 *, bootstrap: BootstrapFields | None = None,
                 **disaggregation: Any) -> Output | list[Output] | Chunks:
        """Generate for one prompt (returns a dict; a list of n with n > 1) or a list of prompts (returns a list, n
        results per prompt, in order).

        With stream=True (one prompt, n=1) returns a generator of chunks: `text` is cumulative, logprob lists
        hold only the new entries; closing it early aborts the request. With `timeout` (seconds, not for streams)
        requests still unfinished then are aborted and TimeoutError is raised. `image_data` (vision-language
        models): one image per prompt or a list per prompt, each a path, bytes, a PIL image, a base64 string or a
        data: URL, shown where the prompt has the model's image placeholder. `bootstrap` pairs a request's halves
        on prefill and decode engines (disaggregation_mode); SGLang's bootstrap_host, bootstrap_port and
        bootstrap_room keywords do the same.
        """
        return self._generate(GenerateRequest(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                              top_logprobs_num, return_text_in_logprobs, stream, rid, timeout,
                                              image_data, bootstrap_of(bootstrap, disaggregation)))

    @overload
    async def async_generate(self, prompt: str | None = None, sampling_params: SamplingArg = None,
                             input_ids: list[int] | None = None, *, stream: Literal[True],
                             **options: Unpack[GenerateOptions]) -> AsyncChunks: ...

    @overload
    async def async_generate(self, prompt: list[str] | None = None, sampling_params: SamplingArg = None,
                             input_ids: list[list[int]] | None = None, *, stream: Literal[False] = False,
                             **options: Unpack[GenerateOptions]) -> list[Output]: ...

    @overload
    async def async_generate(self, prompt: str | None = None, sampling_params: SamplingArg = None,
                             input_ids: list[int] | None = None, *, stream: Literal[False] = False,
                             **options: Unpack[GenerateOptions]) -> Output | list[Output]: ...

    @overload
    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: SamplingArg = None,
                             input_ids: list[int] | list[list[int]] | None = None, *, stream: bool = False,
                             **options: Unpack[GenerateOptions]) -> Output | list[Output] | AsyncChunks: ...

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: SamplingArg = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0,
                             return_text_in_logprobs: bool = False, stream: bool = False, rid: str | None = None,
                             timeout: float | None = None, image_data: Any = None, *,
                             bootstrap: BootstrapFields | None = None,
                             **disaggregation: Any) -> Output | list[Output] | AsyncChunks:
        """Async twin of generate(); with stream=True returns an async generator of chunks (aclose() it to stop
        early), whose request is sent when it is first read."""
        return await self._async_generate(GenerateRequest(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            return_text_in_logprobs, stream, rid, timeout, image_data, bootstrap_of(bootstrap, disaggregation)))

    @property
    def image_placeholder(self) -> str | None:
        """The text that shows one image in a prompt (LLaVA's `<image>`, Qwen2-VL's
        `<|vision_start|><|image_pad|><|vision_end|>`); None for a text-only model."""
        images = self.builder.images
        if images is None:
            return None
        spec = images.spec
        start, end = spec.wrap_token_ids or (None, None)
        ids = [spec.image_token_id] if start is None else [start, spec.image_token_id, end]
        return "".join(self.tokenizer.convert_ids_to_tokens(ids))

    @property
    def image_tokens(self) -> int | None:
        """Prompt tokens one image takes (0 for a text-only model); None: each image its own (Qwen2-VL)."""
        return 0 if self.builder.images is None else self.builder.images.spec.tokens_per_image

    def abort(self, rid: str) -> None:
        """Abort request `rid`, and the requests a list or n > 1 call derived from it (`rid-i-j`)."""
        derived = [r for r in self._link.in_flight() if r.startswith(f"{rid}-")]
        for one in [rid, *derived]:
            self._link.abort(one)

    def num_in_flight(self) -> int:
        return len(self._link.in_flight())

    def get_stats(self) -> dict[str, Any]:
        """Scheduler counters (forward time, KV pool occupancy, running and waiting requests) and this side's
        structured-output checks (schema_checked, schema_violations, schema_incomplete, schema_unchecked)."""
        return {**self._rpc(GetStats()), **self.schema_checker.stats()}

    def get_load(self) -> dict[str, Any]:
        """get_stats' scheduler counters as of its latest step, answered at once however long the step running now
        takes (/get_load, /metrics), and the requests still on their way to it (`pending`)."""
        return {**self._link.load, "pending": self._link.outbox.pending()}

    def flush_cache(self) -> bool:
        """Drop the prefix cache; False (nothing done) while running requests hold parts of it."""
        return self.flush_cache_result()[0]

    def flush_cache_result(self) -> tuple[bool, str]:
        """flush_cache with the reason when it was refused."""
        return self._control(FlushCache())

    def check_integrity(self) -> bool:
        """Verify the scheduler's KV bookkeeping (every slot free, cached or owned by one request)."""
        return self._rpc(CheckIntegrity())

    def shutdown(self) -> None:
        if self._link.closed:
            return
        self._link.closed = True
        if self._process.poll() is None and self._link.dead is None:
            try:
                self._rpc(Shutdown(), timeout=30)
                self._process.wait(timeout=10)
            except (RuntimeError, OSError, TimeoutError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        self._link.close(RuntimeError("engine was shut down"))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        link = getattr(self, "_link", None)
        if link is not None and link.receiver.ident is not None and not link.closed:  # started, not shut down
            self.shutdown()

    # -- plumbing -----------------------------------------------------------------------------------------

    def is_alive(self) -> bool:
        """True while the engine can serve: not shut down, scheduler process running, receiver listening."""
        link = self._link
        return not link.closed and link.dead is None and self._process.poll() is None and link.receiver.is_alive()

    def _check_capacity(self, count: int) -> None:
        """Refuse a call at once, all of it, when its requests would queue past max_queued_requests."""
        limit = self.args.max_queued_requests
        if limit is None:
            return
        capacity = self.args.max_running_requests + limit
        in_flight = self.num_in_flight()
        if in_flight + count > capacity:
            raise QueueFullError(f"the request queue is full ({in_flight} requests in flight, room for {capacity}"
                                 f" with max_queued_requests={limit}); retry later")

    def _submit(self, req: TokenizedGenerateReq, return_text: bool, sink) -> RequestState:
        state = RequestState(req, self.tokenizer, return_text, sink, self.schema_checker)
        self._link.submit(state)
        return state

    def _abandon(self, state: RequestState) -> None:
        self._link.abandon(state)

    def _generate(self, call: GenerateRequest) -> Output | list[Output] | Chunks:
        deadline = None if call.timeout is None else time.monotonic() + call.timeout  # tokenizing counts too
        reqs, single = self.builder.build(call)
        self._check_capacity(len(reqs))
        if call.stream:
            sink: queue.Queue = queue.Queue()
            state = self._submit(reqs[0], call.return_text_in_logprobs, sink.put)
            return _Reader(state, self._abandon).chunks(sink.get)
        results = self._wait_all(reqs, call.return_text_in_logprobs, deadline)
        return results[0] if single else results

    def _wait_all(self, reqs: list[TokenizedGenerateReq], return_text: bool, deadline: float | None) -> list[Output]:
        with contextlib.ExitStack() as readers:  # one item failed: the others must not run on, unowned
            waits = []
            for req in reqs:
                sink: queue.Queue = queue.Queue()
                reader = readers.enter_context(_Reader(self._submit(req, return_text, sink.put), self._abandon))
                waits.append((reader, sink))
            return [self._wait_result(reader, sink, deadline) for reader, sink in waits]

    @staticmethod
    def _wait_result(reader: _Reader, sink: queue.Queue, deadline: float | None) -> Output:
        """A request nobody streams puts one item in its sink: the whole result, or the error."""
        try:
            item = sink.get(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
        except queue.Empty:
            raise TimeoutError(f"request {reader.state.req.rid} did not finish in time") from None
        return reader.take(item)

    async def _async_generate(self, call: GenerateRequest) -> Output | list[Output] | AsyncChunks:
        if call.texts is None and call.image_data is None:  # token ids: nothing slow to do
            reqs, single = self.builder.build(call)
        else:  # tokenizing a long prompt must not stall every other coroutine on this loop (fast tokenizers
            # release the GIL); the thread raises the same ValueError here
            reqs, single = await asyncio.to_thread(self.builder.build, call)
        self._check_capacity(len(reqs))
        if call.stream:
            return self._stream_async(reqs[0], call.return_text_in_logprobs)
        tasks = [asyncio.ensure_future(self._await_one(req, call.return_text_in_logprobs)) for req in reqs]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), call.timeout)
        except BaseException:
            for task in tasks:  # cancelling a waiter aborts its request (see _await_one)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return results[0] if single else list(results)

    async def _await_one(self, req: TokenizedGenerateReq, return_text: bool) -> Output:
        state, sink = self._submit_async(req, return_text)
        with _Reader(state, self._abandon) as reader:  # cancelled: leaving the reader aborts the request
            return reader.take(await sink.get())

    async def _stream_async(self, req: TokenizedGenerateReq, return_text: bool) -> AsyncChunks:
        """Submitted on the first read: a stream nobody reads never runs."""
        state, sink = self._submit_async(req, return_text)
        async with contextlib.aclosing(_Reader(state, self._abandon).async_chunks(sink.get)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _submit_async(self, req: TokenizedGenerateReq, return_text: bool) -> tuple[RequestState, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()

        def deliver(item: Any) -> None:
            if not loop.is_closed():  # the caller's loop may be gone (asyncio.run returned); nobody to tell
                loop.call_soon_threadsafe(sink.put_nowait, item)

        state = self._submit(req, return_text, deliver)
        return state, sink

    def _rpc(self, call: Any, timeout: float = 60) -> Any:
        """A control call (wire/control_calls.py, wire/weight_messages.py) answered by the scheduler."""
        return self._link.rpc(call, timeout)
