"""OpenAI's routes: /v1/models, /v1/completions, /v1/chat/completions (streaming, n, logprobs, response_format)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..engine.engine import Engine
from ..engine.generate_request import BootstrapFields
from . import openai_format as fmt
from . import tool_calls
from .answer import AnswerPlan
from .chat_render import render_chat
from .errors import ApiError, read_json_object
from .image_fields import checked_images
from .keys import ENGINE, SETTINGS
from .openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, parse
from .router_fields import BOOTSTRAP_FIELDS, strip_router_fields
from .sse import open_stream, send_done, send_error, send_event, stop_pumps

STARTED = int(time.time())
# Router-added fields these routes parse themselves (an unknown model is a 404 here).
OPENAI_OWN = frozenset({"model"})
CHAT_OWN = frozenset({"model", "separate_reasoning"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)


@dataclass
class Job:
    """One OpenAI request turned into engine prompts: each prompt is sampled `n` times."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[list[int]]
    sampling: list[dict[str, Any]]
    logprobs: int | None  # top logprobs per token (0: the chosen token's only); None: no logprobs
    echo_texts: list[str] = field(default_factory=list)  # completions with echo: the prompt text per prompt
    rid: str | None = None
    bootstrap: BootstrapFields | None = None  # prefill/decode pairing fields from the router
    images: list[list[Any]] | None = None  # per prompt, the images its placeholders show (chat image_url parts)

    @property
    def n(self) -> int:
        return self.sampling[0]["n"]


def served_names(request: web.Request) -> list[str]:
    engine = request.app[ENGINE]
    names = [request.app[SETTINGS].served_model_name or engine.args.model_path, engine.model_path]
    return list(dict.fromkeys(names))


def checked_model(request: web.Request, req: SamplingFields) -> str:
    names = served_names(request)
    if req.model is not None and req.model not in names:
        raise ApiError(404, f"model {req.model!r} is not served here; this server serves {names[0]!r}",
                       "model_not_found")
    return names[0]


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    data = [{"id": served_names(request)[0], "object": "model", "created": STARTED, "owned_by": "furcate",
             "root": engine.model_path, "max_model_len": engine.info.context_length}]
    return web.json_response({"object": "list", "data": data})


async def completions(request: web.Request) -> web.StreamResponse:
    req: CompletionRequest = parse(CompletionRequest, strip_router_fields(await read_json_object(request), OPENAI_OWN))
    engine = request.app[ENGINE]
    prompt_ids = _completion_prompts(engine, req.prompt)
    echo = [engine.tokenizer.decode(ids) for ids in prompt_ids] if req.echo else []
    job = Job("completion", checked_model(request, req), prompt_ids,
              _per_prompt_sampling(engine, req, req.max_tokens, prompt_ids), req.logprobs, echo, req.rid,
              _bootstrap(req))
    return await _run(request, job, req)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = strip_router_fields(await read_json_object(request), CHAT_OWN)
    req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    tools, choice = tool_calls.request_tools(req)
    call = tool_calls.call_format(engine, settings, choice)
    # An answer of several parts cannot follow one prefill/decode pairing: under the PD router reasoning stays in
    # the text (tool calls are refused in answer_plan).
    paired = any(getattr(req, name) is not None for name in BOOTSTRAP_FIELDS)
    reasoning = tool_calls.server_reasoning(engine, settings) if req.separate_reasoning and not paired else None
    images = [url for m in req.messages for url in fmt.message_images(m.content)]
    if images and engine.image_placeholder is None:
        raise ApiError(400, "image_url parts need a vision-language model; the served model reads text only")
    prompt = render_chat(engine, req, tools)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true")
    # Each placeholder becomes the image's tokens; at least itself where each image's count is its own (Qwen2-VL).
    shown = len(ids) + len(images) * ((engine.image_tokens or 1) - 1)
    sampling = _per_prompt_sampling(engine, req, limit, [[0] * shown])
    shown_images = checked_images(images, settings.allow_local_images) if images else None
    if choice.calls or reasoning is not None:
        if paired:
            raise ApiError(400, "tool calls are not available under prefill/decode disaggregation yet")
        plan = tool_calls.answer_plan(req, ids, prompt, sampling[0], tools, choice, call, reasoning, shown_images)
        return await _answer(request, plan, req)
    job = Job("chat", checked_model(request, req), [ids], sampling, top, rid=req.rid, bootstrap=_bootstrap(req),
              images=[shown_images] if images else None)
    return await _run(request, job, req)


async def _answer(request: web.Request, plan: AnswerPlan, req: ChatCompletionRequest) -> web.StreamResponse:
    engine: Engine = request.app[ENGINE]
    model = checked_model(request, req)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await tool_calls.stream(request, engine, plan, req.n, model, include_usage)
    try:
        results = await tool_calls.complete(engine, plan, req.n)
    except ValueError as error:
        raise ApiError(400, str(error)) from None
    body = fmt.envelope("chat.completion", fmt.response_id("chatcmpl"), model,
                        choices=tool_calls.choices(results, plan),
                        usage=fmt.usage(len(plan.prompt_ids), sum(r.completion_tokens for r in results),
                                        results[0].cached_tokens))
    return web.json_response(body)


def _bootstrap(req: SamplingFields) -> BootstrapFields | None:
    return BootstrapFields.from_keywords({name: getattr(req, name) for name in BOOTSTRAP_FIELDS})


def _completion_prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [_encode(engine, prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise ApiError(400, "prompt must not be empty")
    return [_encode(engine, p) if isinstance(p, str) else list(p) for p in prompt]


def _encode(engine: Engine, text: str) -> list[int]:
    if not text:
        raise ApiError(400, "prompt must not be empty")
    try:
        return engine.tokenizer.encode(text)
    except UnicodeEncodeError as error:
        raise ApiError(400, f"prompt is not valid text: {error.reason} at position {error.start}") from None


def _per_prompt_sampling(engine: Engine, req: SamplingFields, limit: int | None,
                         prompt_ids: list[list[int]]) -> list[dict[str, Any]]:
    """A max token count left unset means: as many as the context leaves after the prompt."""
    room = [max(engine.info.max_req_len - len(ids), 0) for ids in prompt_ids]
    return [fmt.engine_sampling(req, limit if limit is not None else r) for r in room]


async def _run(request: web.Request, job: Job, req: SamplingFields) -> web.StreamResponse:
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(request, job, include_usage)
    engine: Engine = request.app[ENGINE]
    results = await engine.async_generate(input_ids=job.prompt_ids, sampling_params=job.sampling,
                                          rid=job.rid, image_data=job.images, bootstrap=job.bootstrap,
                                          **_logprob_args(job))
    choices = [_choice(job, index, result) for index, result in enumerate(results)]
    prompt_tokens = sum(len(ids) for ids in job.prompt_ids)
    cached = sum(r["meta_info"]["cached_tokens"] for r in results[:: job.n])
    body = fmt.envelope("text_completion" if job.kind == "completion" else "chat.completion",
                        fmt.response_id("cmpl" if job.kind == "completion" else "chatcmpl"), job.model,
                        choices=choices, usage=fmt.usage(prompt_tokens, sum(r["meta_info"]["completion_tokens"]
                                                                             for r in results), cached))
    return web.json_response(body)


def _logprob_args(job: Job) -> dict[str, Any]:
    if job.logprobs is None:
        return {}
    start = 0 if job.echo_texts else -1
    return {"return_logprob": True, "top_logprobs_num": job.logprobs, "return_text_in_logprobs": True,
            "logprob_start_len": start}


def _choice(job: Job, index: int, result: dict[str, Any]) -> dict[str, Any]:
    meta = result["meta_info"]
    choice: dict[str, Any] = {"index": index, "finish_reason": fmt.finish_reason(meta),
                              "matched_stop": fmt.matched_stop(meta)}
    if job.kind == "chat":
        choice["message"] = {"role": "assistant", "content": result["text"]}
        choice["logprobs"] = (None if job.logprobs is None else
                              fmt.chat_logprobs(meta["output_token_logprobs"], meta.get("output_top_logprobs")))
        return choice
    echo = job.echo_texts[index // job.n] if job.echo_texts else ""
    choice["text"] = echo + result["text"]
    choice["logprobs"] = None if job.logprobs is None else _completion_logprobs(meta, bool(echo))
    return choice


def _completion_logprobs(meta: dict[str, Any], echo: bool) -> dict[str, Any]:
    entries, tops = list(meta["output_token_logprobs"]), list(meta.get("output_top_logprobs") or [])
    if echo:
        entries = list(meta["input_token_logprobs"]) + entries
        tops = list(meta.get("input_top_logprobs") or [None] * len(meta["input_token_logprobs"])) + tops
    return fmt.completion_logprobs(entries, tops if meta.get("output_top_logprobs") is not None else None, 0)


# -- streaming ---------------------------------------------------------------------------------------------------


async def _stream(request: web.Request, job: Job, include_usage: bool) -> web.StreamResponse:
    """Every (prompt, sample) pair is its own engine stream; their chunks are merged as they come, by index."""
    engine: Engine = request.app[ENGINE]
    streams = await _open_streams(engine, job)
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(index, chunks, queue)) for index, chunks in enumerate(streams)]
    try:
        firsts = [await queue.get() for _ in streams]  # a request that fails early still gets a 4xx status
        for _, item in firsts:
            if isinstance(item, Exception):
                raise item
        response = await open_stream(request)
        writer = _ChunkWriter(job, response)
        for index, item in firsts:
            await writer.write(index, item)
        pending = sum(1 for _, item in firsts if item["meta_info"]["finish_reason"] is None)
        while pending:
            index, item = await queue.get()
            if isinstance(item, Exception):
                await send_error(response, item)
                break
            await writer.write(index, item)
            pending -= item["meta_info"]["finish_reason"] is not None
        if include_usage:
            await send_event(response, writer.usage_chunk())
        await send_done(response)
        return response
    finally:
        await stop_pumps(pumps)
        for chunks in streams:
            await chunks.aclose()  # aborts what has not finished (a client that went away)


async def _open_streams(engine: Engine, job: Job) -> list[AsyncIterator[dict[str, Any]]]:
    streams: list[AsyncIterator[dict[str, Any]]] = []
    try:
        for p, (ids, sampling) in enumerate(zip(job.prompt_ids, job.sampling)):
            for sample in range(job.n):
                one = dict(sampling, n=1)
                if "sampling_seed" in one:
                    one["sampling_seed"] += sample
                rid = None if job.rid is None else (job.rid if len(job.prompt_ids) * job.n == 1
                                                    else f"{job.rid}-{p}-{sample}")
                images = None if job.images is None else job.images[p]
                streams.append(await engine.async_generate(input_ids=ids, sampling_params=one, stream=True, rid=rid,
                                                           image_data=images, bootstrap=job.bootstrap,
                                                           **_logprob_args(job)))
    except BaseException:
        for chunks in streams:
            await chunks.aclose()
        raise
    return streams


async def _pump(index: int, chunks: AsyncIterator[dict[str, Any]], queue: asyncio.Queue) -> None:
    try:
        async for chunk in chunks:
            await queue.put((index, chunk))
    except (ValueError, RuntimeError) as error:
        await queue.put((index, error))


class _ChunkWriter:
    """Turns cumulative engine chunks into OpenAI deltas, one SSE event per chunk."""

    def __init__(self, job: Job, response: web.StreamResponse) -> None:
        self.job = job
        self.response = response
        self.id = fmt.response_id("cmpl" if job.kind == "completion" else "chatcmpl")
        count = len(job.prompt_ids) * job.n
        self.sent = [""] * count
        self.completion_tokens = [0] * count
        self.cached_tokens = [0] * count
        self.offsets = [0] * count
        self.started: set[int] = set()

    async def write(self, index: int, chunk: dict[str, Any]) -> None:
        meta = chunk["meta_info"]
        first = index not in self.started
        self.started.add(index)
        text = chunk["text"]
        delta = text[len(self.sent[index]):] if text.startswith(self.sent[index]) else ""
        self.sent[index] = text if text.startswith(self.sent[index]) else self.sent[index]
        self.completion_tokens[index] = meta["completion_tokens"]
        self.cached_tokens[index] = meta["cached_tokens"]
        if self.job.kind == "chat":
            payload = self._chat_chunk(index, delta, meta, first)
        else:
            payload = self._completion_chunk(index, delta, meta, first)
        await send_event(self.response, payload)

    def _chat_chunk(self, index: int, delta: str, meta: dict[str, Any], first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": {"content": delta, **({"role": "assistant"} if first
                                                                                 else {})},
                                  "finish_reason": fmt.finish_reason(meta), "logprobs": None,
                                  "matched_stop": fmt.matched_stop(meta)}
        if self.job.logprobs is not None:
            choice["logprobs"] = fmt.chat_logprobs(meta["output_token_logprobs"], meta.get("output_top_logprobs"))
        return fmt.envelope("chat.completion.chunk", self.id, self.job.model, choices=[choice])

    def _completion_chunk(self, index: int, delta: str, meta: dict[str, Any], first: bool) -> dict[str, Any]:
        if first and self.job.echo_texts:
            delta = self.job.echo_texts[index // self.job.n] + delta
        choice: dict[str, Any] = {"index": index, "text": delta, "finish_reason": fmt.finish_reason(meta),
                                  "logprobs": None, "matched_stop": fmt.matched_stop(meta)}
        if self.job.logprobs is not None:
            logprobs = _completion_logprobs(meta, first and bool(self.job.echo_texts))
            logprobs["text_offset"] = [o + self.offsets[index] for o in logprobs["text_offset"]]
            self.offsets[index] += sum(len(t) for t in logprobs["tokens"])
            choice["logprobs"] = logprobs
        return fmt.envelope("text_completion", self.id, self.job.model, choices=[choice])

    def usage_chunk(self) -> dict[str, Any]:
        prompt_tokens = sum(len(ids) for ids in self.job.prompt_ids)
        kind = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        return fmt.envelope(kind, self.id, self.job.model, choices=[],
                            usage=fmt.usage(prompt_tokens, sum(self.completion_tokens),
                                            sum(self.cached_tokens[:: self.job.n])))
