"""Engine-side state of one request: accumulates scheduler outputs into the result dicts users see."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..wire.finish_reason import PEER_FAILURE, FinishReason
from ..wire.messages import PeerServerError, ReqOutput, SpecCounts, TokenizedGenerateReq, vocabulary_ids
from .detokenizer import IncrementalDetokenizer, stream_holdback, trim_stop
from .schema_check import SchemaChecker, SchemaVerdict


class RequestState:
    def __init__(self, req: TokenizedGenerateReq, tokenizer, return_text_in_logprobs: bool,
                 sink: Callable[[dict[str, Any] | Exception], None],
                 schema_checker: SchemaChecker | None = None) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.return_text = return_text_in_logprobs
        self.sink = sink  # receives each chunk (or the error) as it arrives; called from the receiver thread
        params = req.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                                  params.spaces_between_special_tokens)
        self.holdback = stream_holdback(params.stop)
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.prompt_tokens = len(req.input_ids)
        self.cached_tokens = 0
        self.spec: SpecCounts | None = None
        self.weight_version: str | None = None
        self.logprobs: dict[str, list] = {}
        self.created = time.perf_counter()
        # Timing for the server's metrics: when the first output token arrived, and the seconds per token
        # between later arrivals (one sample per output chunk: a jump-forward chunk spreads over its tokens).
        # A request nobody streams gets two chunks, its first tokens at once and the rest when it ends: each of
        # those later tokens is one sample of its mean time per token after the first.
        self.first_token_at: float | None = None
        self.inter_token_latencies: list[float] = []
        self.last_token_at = 0.0
        # json_schema requests get their finished text validated; no other request touches the checker.
        grammar = params.grammar
        self.schema = grammar.spec if grammar is not None and grammar.kind == "json_schema" else None
        self.schema_checker = schema_checker
        self.schema_verdict: SchemaVerdict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: ReqOutput) -> None:
        """Fold one scheduler output in, then hand the sink the incremental chunk (a streamed request) or, once
        finished, the whole result (a request nobody streams: its sink gets that one item, or an error)."""
        self._time_tokens(len(out.new_token_ids))
        self.output_ids.extend(out.new_token_ids)
        self.finish_reason = out.finish_reason or self.finish_reason
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.spec = out.spec or self.spec  # totals: the latest is the whole count
        self.weight_version = out.weight_version or self.weight_version
        new_logprobs = self._logprob_entries(out) if self.req.return_logprob else {}
        for key, entries in new_logprobs.items():
            self.logprobs.setdefault(key, []).extend(entries)
        if self.finish_reason is not None and self.finish_reason.is_error:  # e.g. its grammar does not compile
            status = self.finish_reason.status
            error_type = ValueError if status < 500 else PeerServerError if status == PEER_FAILURE else RuntimeError
            self.sink(error_type(self.finish_reason.message))
            return
        if self.schema is not None and self.schema_checker is not None and out.finish_reason is not None:
            self._check_schema()
        if self.req.stream:
            self.sink(self._chunk(new_logprobs))
        elif self.finished:  # nobody reads a partial result: no decode, no chunk until the whole one
            self.sink(self.result())

    def _check_schema(self) -> None:
        if self.finish_reason.is_abort:  # no finished output to judge
            return
        cut = cut_by(self.finish_reason, self.req.sampling_params.stop_token_ids)
        self.schema_verdict = self.schema_checker.check(self.schema, self._content_text(), cut)

    def _content_text(self) -> str:
        """The output as the schema sees it: without the stop token that ended it (shown when special tokens are)."""
        ids = self.output_ids
        if ids and ids[-1] == self.finish_reason.stop_token_id:
            ids = ids[:-1]
        return trim_stop(self.detokenizer.decode(ids), self.finish_reason, self.req.sampling_params.no_stop_trim)

    def _time_tokens(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            samples = 1 if self.req.stream else count  # unstreamed, the tokens of one chunk came in steps of their own
            self.inter_token_latencies.extend([(now - self.last_token_at) / count] * samples)
        self.last_token_at = now

    def fail(self, error: Exception) -> None:
        self.finish_reason = FinishReason.abort(str(error))
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
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_dict(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.weight_version is not None:
            meta["weight_version"] = self.weight_version
        if self.schema_verdict is not None:
            meta.update(self.schema_verdict.meta())
        if self.spec is not None:
            meta.update(self.spec.meta())
        if self.req.return_logprob:
            meta["input_token_logprobs"] = logprobs.get("input_token_logprobs", [])
            meta["output_token_logprobs"] = logprobs.get("output_token_logprobs", [])
            # SGLang's running count beside a stream's incremental entries (the same in a whole result)
            meta["output_token_logprobs_length"] = len(self.logprobs.get("output_token_logprobs", []))
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
            prompt = vocabulary_ids(self.req.input_ids, self.req.images)[out.input_logprob_start :]
            entries["input_token_logprobs"] = self._triples(zip(out.input_logprobs, prompt))
            entries["input_top_logprobs"] = [None if top is None else self._triples(top)
                                             for top in (out.input_top_logprobs or [])]
        return entries

    def _triples(self, pairs) -> list[tuple[float | None, int, str | None]]:
        pairs = list(pairs)
        texts = [self.tokenizer.decode([t]) for _, t in pairs] if self.return_text else [None] * len(pairs)
        return [(lp, t, text) for (lp, t), text in zip(pairs, texts)]


def cut_by(reason: FinishReason, stop_token_ids: list[int]) -> str | None:
    """What ended an output before its grammar did, or None: under a grammar only the grammar's own end lets the
    model's EOS through, so any other stop is a cut."""
    if reason.kind == "length":
        return "length"
    if reason.stop_text is not None:
        return "stop string"
    return "stop token" if reason.stop_token_id in stop_token_ids else None
