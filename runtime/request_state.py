"""Engine-side state of one request: accumulates scheduler outputs into the result dicts users see."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .detokenizer import IncrementalDetokenizer, stream_holdback, trim_stop
from .io import ReqOutput, TokenizedGenerateReq


class RequestState:
    def __init__(self, req: TokenizedGenerateReq, tokenizer, return_text_in_logprobs: bool,
                 sink: Callable[[dict[str, Any] | Exception], None]) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.return_text = return_text_in_logprobs
        self.sink = sink  # receives each chunk (or the error) as it arrives; called from the receiver thread
        params = req.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                                  params.spaces_between_special_tokens)
        self.holdback = stream_holdback(params.stop)
        self.output_ids: list[int] = []
        self.finish_reason: dict[str, Any] | None = None
        self.prompt_tokens = len(req.input_ids)
        self.cached_tokens = 0
        self.logprobs: dict[str, list] = {}
        self.created = time.perf_counter()
        # Timing for the server's metrics: when the first output token arrived, and the seconds per token
        # between later arrivals (one sample per output chunk: a jump-forward chunk spreads over its tokens).
        self.first_token_at: float | None = None
        self.inter_token_latencies: list[float] = []
        self.last_token_at = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: ReqOutput) -> None:
        """Fold one scheduler output in, then hand the incremental chunk to the sink."""
        self._time_tokens(len(out.new_token_ids))
        self.output_ids.extend(out.new_token_ids)
        self.finish_reason = out.finish_reason or self.finish_reason
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        new_logprobs = self._logprob_entries(out) if self.req.return_logprob else {}
        for key, entries in new_logprobs.items():
            self.logprobs.setdefault(key, []).extend(entries)
        status = (self.finish_reason or {}).get("status_code")
        if status is not None:  # the scheduler refused this request (e.g. its grammar does not compile)
            error_type = ValueError if status < 500 else RuntimeError
            self.sink(error_type(self.finish_reason["message"]))
            return
        self.sink(self._chunk(new_logprobs))

    def _time_tokens(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.inter_token_latencies.append((now - self.last_token_at) / count)
        self.last_token_at = now

    def fail(self, error: Exception) -> None:
        self.finish_reason = {"type": "abort", "message": str(error)}
        self.sink(error)

    def result(self) -> dict[str, Any]:
        """The whole output, as a non-streaming call returns it."""
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": self._meta(self.logprobs)}

    def text(self) -> str:
        if self.finished:
            full = self.detokenizer.decode(self.output_ids)
            return trim_stop(full, self.finish_reason, self.req.sampling_params.no_stop_trim)
        text = self.detokenizer.update(self.output_ids)
        return text[: max(len(text) - self.holdback, 0)]

    def _chunk(self, new_logprobs: dict[str, list]) -> dict[str, Any]:
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": self._meta(new_logprobs)}

    def _meta(self, logprobs: dict[str, list]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.req.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.req.return_logprob:
            meta["input_token_logprobs"] = logprobs.get("input_token_logprobs", [])
            meta["output_token_logprobs"] = logprobs.get("output_token_logprobs", [])
            if self.req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = logprobs.get("input_top_logprobs", [])
                meta["output_top_logprobs"] = logprobs.get("output_top_logprobs", [])
        return meta

    def _logprob_entries(self, out: ReqOutput) -> dict[str, list]:
        entries: dict[str, list] = {
            "output_token_logprobs": self._triples(zip(out.output_logprobs, out.new_token_ids)),
            "output_top_logprobs": [self._triples(top) for top in out.output_top_logprobs],
        }
        if out.input_logprobs is not None:
            prompt = self.req.input_ids[out.input_logprob_start :]
            entries["input_token_logprobs"] = self._triples(zip(out.input_logprobs, prompt))
            entries["input_top_logprobs"] = [None if top is None else self._triples(top)
                                             for top in (out.input_top_logprobs or [])]
        return entries

    def _triples(self, pairs) -> list[tuple[float | None, int, str | None]]:
        pairs = list(pairs)
        texts = [self.tokenizer.decode([t]) for _, t in pairs] if self.return_text else [None] * len(pairs)
        return [(lp, t, text) for (lp, t), text in zip(pairs, texts)]
