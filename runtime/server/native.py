"""SGLang's native routes: /generate (single, batch, streaming), health, model and server info, cache, abort,
and the parallel-encoding join of SGLang's own client."""

from __future__ import annotations

import asyncio
import dataclasses

from aiohttp import web

from ...version import __version__
from ..engine.engine import Engine
from ..engine.generate_request import BootstrapFields
from ..sampling.params import MAX_N
from .errors import ApiError, check_fields, read_json_object
from .image_fields import checked_images
from .keys import ENGINE, METRICS, SETTINGS
from .router_fields import BOOTSTRAP_FIELDS, strip_router_fields
from .sse import open_stream, send_done, send_event

GENERATE_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream", "rid", "image_data", *BOOTSTRAP_FIELDS,
})
HEALTH_GENERATE_TIMEOUT_S = 20.0
CONCAT_FIELDS = frozenset({"src_rids", "dst_rid"})
MAX_CONCAT_SOURCES = MAX_N  # a join gathers one fork's children, and a fork has at most n of them
MAX_RID_CHARS = 256


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/model_info", get_model_info)  # the name sglang-router asks first
    app.router.add_get("/server_info", get_server_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/concate_and_append_request", concate_and_append_request)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE]


async def generate(request: web.Request) -> web.StreamResponse:
    body = strip_router_fields(await read_json_object(request))
    check_fields(body, GENERATE_FIELDS)
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None and input_ids is not None:
        raise ApiError(400, "send either text or input_ids, not both")
    args = {
        "prompt": text, "input_ids": input_ids, "sampling_params": body.get("sampling_params"),
        "return_logprob": body.get("return_logprob", False), "rid": body.get("rid"),
        "logprob_start_len": body.get("logprob_start_len", -1), "top_logprobs_num": body.get("top_logprobs_num", 0),
        "return_text_in_logprobs": body.get("return_text_in_logprobs", False),
        "image_data": checked_images(body.get("image_data"), request.app[SETTINGS].allow_local_images),
        "bootstrap": BootstrapFields.from_keywords({name: body.get(name) for name in BOOTSTRAP_FIELDS}),
    }
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}")
    engine = _engine(request)
    if not stream:
        return web.json_response(await engine.async_generate(**args))
    return await _stream_generate(request, await engine.async_generate(**args, stream=True))


async def _stream_generate(request: web.Request, chunks) -> web.StreamResponse:
    """Stream the chunks as SSE. The first chunk is awaited before the response starts, so a request that fails
    early (a grammar that does not compile) still gets a 4xx status instead of an error inside a 200 stream."""
    try:
        first = await anext(chunks)
        response = await open_stream(request)
        await send_event(response, first)
        try:
            async for chunk in chunks:
                await send_event(response, chunk)
        except (ValueError, RuntimeError) as error:
            status = 400 if isinstance(error, ValueError) else 500
            await send_event(response, {"error": {"message": str(error), "code": status}})
        await send_done(response)
        return response
    finally:
        await chunks.aclose()  # a client gone mid-stream: closing the generator aborts the request


async def health(request: web.Request) -> web.Response:
    if not _engine(request).is_alive():
        raise ApiError(503, "the engine is not running")
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    """Healthy when a one-token generation completes: the scheduler is not just alive but serving."""
    engine = _engine(request)
    if not engine.is_alive():
        raise ApiError(503, "the engine is not running")
    try:
        await engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1},
                                    timeout=HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, RuntimeError) as error:
        raise ApiError(503, f"generation is not working: {error}") from None
    return web.Response(text="")


async def get_model_info(request: web.Request) -> web.Response:
    engine = _engine(request)
    tokenizer = engine.tokenizer
    return web.json_response({
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "served_model_name": request.app[SETTINGS].served_model_name or engine.model_path,
        "is_generation": True,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
        "special_tokens_map": tokenizer.special_tokens_map,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "vocab_size": engine.info.vocab_size,
        "context_length": engine.info.context_length,
        "max_req_len": engine.info.max_req_len,
        # A vision-language model's image placeholder text and the tokens each becomes (RuntimeEndpoint reads them).
        "image_placeholder": engine.image_placeholder, "tokens_per_image": engine.image_tokens,
    })


async def get_server_info(request: web.Request) -> web.Response:
    engine = _engine(request)
    stats = await asyncio.to_thread(engine.get_stats)
    if request.query.get("check_integrity") in ("1", "true"):  # a full scan of the KV bookkeeping (tests, debugging)
        stats["kv_integrity"] = await asyncio.to_thread(engine.check_integrity)
    settings = dataclasses.asdict(request.app[SETTINGS])
    settings.pop("api_key")  # never echo the secret
    return web.json_response({"version": __version__, **dataclasses.asdict(engine.args), **settings,
                              "model_path": engine.model_path, "max_total_num_tokens": engine.info.max_total_tokens,
                              "resolved_dtype": engine.info.dtype, "quantized_layers": engine.info.quantized_layers,
                              "quantized_max_rows": engine.info.quantized_max_rows,
                              "internal_states": [stats]})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's load report, one entry per data-parallel rank (one here); sglang-router's power_of_two policy
    sums num_tokens. num_tokens: KV slots held by requests (cached but unused prefixes excluded). As of the
    scheduler's latest step, so it answers at once; requests not yet taken by the scheduler count as waiting."""
    load = _engine(request).get_load()
    in_use = load["max_total_tokens"] - load["kv_available"] - load["evictable_tokens"]
    waiting = load["waiting"] + load["pending"]
    return web.json_response([{"dp_rank": 0, "num_reqs": load["running"] + waiting, "num_waiting_reqs": waiting,
                               "num_tokens": in_use}])


async def flush_cache(request: web.Request) -> web.Response:
    if request.method not in ("GET", "POST"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
    success, message = await asyncio.to_thread(_engine(request).flush_cache_result)
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's {"rid"} or {"abort_all": true}."""
    body = await read_json_object(request)
    check_fields(body, frozenset({"rid", "abort_all"}))
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise ApiError(400, f"abort_all must be true or false, got {abort_all!r}")
    if not abort_all and (not isinstance(rid, str) or not rid):
        raise ApiError(400, f"rid must be a non-empty string (or send abort_all: true), got {rid!r}")
    await asyncio.to_thread(_engine(request).abort_request, rid or "", abort_all)
    return web.json_response({"success": True})


async def concate_and_append_request(request: web.Request) -> web.Response:
    """SGLang's client sends this from `join("concate_and_append")` (its parallel encoding, on by default) after
    it has appended the children's text to the parent's own copy. Its rids are the client's program ids, which it
    never sends with /generate, so there is nothing on the server to move: each child's text was prefilled by the
    client just before (max_new_tokens 0), and the parent's next /generate sends the joined text, whose longest
    cached prefix the radix cache matches by token ids; the rest is computed at its true positions, so outputs
    stay exact instead of attending to KV encoded at other positions."""
    body = await read_json_object(request)
    check_fields(body, CONCAT_FIELDS)
    src_rids, dst_rid = body.get("src_rids"), body.get("dst_rid")
    if not isinstance(src_rids, list) or not src_rids or len(src_rids) > MAX_CONCAT_SOURCES:
        raise ApiError(400, f"src_rids must be a list of 1 to {MAX_CONCAT_SOURCES} rids, got "
                            f"{_describe(src_rids)}")
    for rid in [*src_rids, dst_rid]:
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_CHARS:
            raise ApiError(400, f"src_rids and dst_rid must be rids (strings of 1 to {MAX_RID_CHARS} characters), "
                                f"got {_describe(rid)}")
    return web.json_response({"success": True, "message": f"{len(src_rids)} sources joined into {dst_rid}"})


def _describe(value: object) -> str:
    """A bad value for an error message, cut short: a rejected body may be megabytes."""
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = repr(value)
    return text if len(text) <= 64 else f"{text[:61]}..."


async def tokenize(request: web.Request) -> web.Response:
    """SGLang's /tokenize: {"prompt": str or list, "add_special_tokens": true} -> {"tokens", "count"}."""
    body = await read_json_object(request)
    check_fields(body, frozenset({"prompt", "add_special_tokens"}))
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    single = isinstance(prompt, str)
    texts = [prompt] if single else prompt
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "prompt must be a string or a non-empty list of strings")
    if not isinstance(special, bool):
        raise ApiError(400, f"add_special_tokens must be true or false, got {special!r}")
    engine = _engine(request)
    try:
        tokens = [engine.tokenizer.encode(t, add_special_tokens=special) for t in texts]
    except UnicodeEncodeError as error:
        raise ApiError(400, f"prompt is not valid text: {error.reason}") from None
    return web.json_response({"tokens": tokens[0] if single else tokens,
                              "count": len(tokens[0]) if single else [len(t) for t in tokens],
                              "max_model_len": engine.info.context_length})


async def detokenize(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    check_fields(body, frozenset({"tokens", "skip_special_tokens"}))
    tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
    engine = _engine(request)
    vocab = engine.info.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab})")
    if not isinstance(skip, bool):
        raise ApiError(400, f"skip_special_tokens must be true or false, got {skip!r}")
    return web.json_response({"text": engine.tokenizer.decode(tokens, skip_special_tokens=skip)})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = await request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})
