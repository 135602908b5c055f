"""A furcate (or SGLang) server over HTTP, through its native protocol: /generate, /tokenize, /get_model_info.

Programs run on it exactly as on the in-process Engine: the same prompts and sampling fields go out, the same
result dicts come back, and select scores choices with the same single prompt-logprob request over token ids
the server's own tokenizer gave.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp

from ..chat_template import ChatTemplate
from .base import TokenScoringBackend, first_special_id, wire_sampling
from .image_wire import wire_images
from .jinja_template import JinjaTemplateTokenizer
from .per_loop import PerLoop

# SSE lines carry a whole chunk (with top logprobs they grow large); aiohttp's default line limit is 128 KiB.
READ_BUFFER_BYTES = 8 * 1024 * 1024
SYNC_TIMEOUT_S = 60.0


def error_message(body: bytes) -> str:
    """The server's error message from a JSON error body (`{"error": {"message": ...}}`), else the raw text."""
    text = body.decode("utf-8", "replace")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text.strip() or "(empty body)"
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def http_error(status: int, message: str, where: str) -> Exception:
    """A refused request (4xx) is the caller's to fix: ValueError; a server failure (5xx) is a RuntimeError."""
    text = f"{message} (HTTP {status} from {where})"
    return ValueError(text) if status < 500 else RuntimeError(text)


class RuntimeEndpoint(TokenScoringBackend):
    """`RuntimeEndpoint(base_url, api_key=None)`: a running furcate server (`furcate serve`) or SGLang server.

    `chat_template` (a Jinja string) overrides the model's; `timeout` bounds each request in seconds (None: a
    generation may take as long as it needs).
    """

    def __init__(self, base_url: str, api_key: str | None = None, chat_template: str | None = None,
                 timeout: float | None = None) -> None:
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError("chat_template must be a Jinja template string")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        # Fetched now: a wrong URL or key fails here, and chat_template() (called on the loop) never blocks.
        self.model_info: dict[str, Any] = self._get_sync("/get_model_info")
        # The tokenizer's special tokens (bos, eos, unk, pad...) are variables the template may use.
        special = {name: value for name, value in (self.model_info.get("special_tokens_map") or {}).items()
                   if isinstance(value, str)}
        special.update({name: self.model_info[name] for name in ("bos_token", "eos_token")
                        if self.model_info.get(name) is not None})
        self._template = ChatTemplate(JinjaTemplateTokenizer(self.model_info.get("chat_template"), special),
                                      chat_template)
        # In practice one session, on the interpreter's loop (programs' requests all run there).
        self._sessions: PerLoop[aiohttp.ClientSession] = PerLoop(self._new_session, aiohttp.ClientSession.close)

    @property
    def endpoint(self) -> RuntimeEndpoint:
        """SGLang programs read `backend.endpoint` (a Runtime's); an endpoint's is itself."""
        return self

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # -- the Backend protocol ---------------------------------------------------------------------------------

    def chat_template(self) -> ChatTemplate:
        return self._template

    @property
    def image_placeholder(self) -> str | None:
        return self.model_info.get("image_placeholder")

    @property
    def image_tokens(self) -> int | None:
        if self.model_info.get("image_placeholder") and self.model_info.get("tokens_per_image") is None:
            return None  # each image its own (Qwen2-VL)
        return int(self.model_info.get("tokens_per_image") or 0)

    async def generate(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                       **logprob_args: Any) -> dict | list[dict]:
        return await self._post("/generate", {"text": prompt, "sampling_params": wire_sampling(sampling),
                                              **_images_field(images), **logprob_args})

    async def generate_stream(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                              **logprob_args: Any) -> AsyncIterator[dict]:
        body = {"text": prompt, "sampling_params": wire_sampling(sampling), **_images_field(images),
                **logprob_args, "stream": True}
        async with self._session().post(self.base_url + "/generate", json=body) as response:
            await self._check(response, "/generate")
            async for chunk in sse_chunks(response):
                yield chunk

    async def encode(self, texts: list[str]) -> list[list[int]]:
        # The server adds special tokens as tokenizer.encode does by default, as the runtime does for a prompt.
        return (await self._post("/tokenize", {"prompt": texts}))["tokens"]

    async def prefill_logprobs(self, input_ids: list[list[int]], logprob_start_len: int,
                               images: Sequence[Any] = ()) -> list[dict]:
        field = {"image_data": [wire_images(images)] * len(input_ids)} if images else {}
        return await self._post("/generate", {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0},
                                              "return_logprob": True, "logprob_start_len": logprob_start_len,
                                              **field})

    def start_token_id(self) -> int:
        return first_special_id(self.model_info.get("bos_token_id"), self.model_info.get("eos_token_id"))

    async def cache_prefix(self, prompt: str, images: Sequence[Any] = ()) -> None:
        await self._post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0},
                                       **_images_field(images)})

    def flush_cache(self) -> bool:
        """True when the server dropped its prefix cache (it refuses while requests are in flight)."""
        status, body = self._request_sync("POST", "/flush_cache")
        try:
            return bool(json.loads(body)["success"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise http_error(status, error_message(body), "/flush_cache") from None

    def get_server_info(self) -> dict[str, Any]:
        return self._get_sync("/get_server_info")

    # -- HTTP -------------------------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _new_session(self) -> aiohttp.ClientSession:
        # No connection limit: a batch of programs sends many requests at once and the server batches them.
        return aiohttp.ClientSession(headers=self._headers(), connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=self.timeout),
                                     read_bufsize=READ_BUFFER_BYTES)

    def _session(self) -> aiohttp.ClientSession:
        return self._sessions.get()

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        async with self._session().post(self.base_url + path, json=body) as response:
            await self._check(response, path)
            return await response.json()

    @staticmethod
    async def _check(response: aiohttp.ClientResponse, path: str) -> None:
        if response.status != 200:
            raise http_error(response.status, error_message(await response.read()), path)

    def _request_sync(self, method: str, path: str) -> tuple[int, bytes]:
        """For the calls made off the loop (construction, flush, info): plain urllib, no session to own."""
        request = urllib.request.Request(self.base_url + path, method=method, headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=self.timeout or SYNC_TIMEOUT_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except urllib.error.URLError as error:
            raise ConnectionError(f"cannot reach the server at {self.base_url}: {error.reason}") from None

    def _get_sync(self, path: str) -> dict[str, Any]:
        status, body = self._request_sync("GET", path)
        if status != 200:
            raise http_error(status, error_message(body), path)
        return json.loads(body)

    # -- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP sessions; the endpoint opens new ones if used again."""
        self._sessions.close_all()


async def sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON chunks of a `data: {json}` event stream, up to `data: [DONE]`; an error event raises."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            status = error.get("code", 500) if isinstance(error, dict) else 500
            raise http_error(status if isinstance(status, int) else 500, error_message(data.encode()),
                             "/generate stream")
        yield chunk
    raise RuntimeError("the server closed the /generate stream before [DONE]")


def _images_field(images: Sequence[Any]) -> dict[str, Any]:
    return {"image_data": wire_images(images)} if images else {}
