"""A request as the scheduler tracks it: prompt, outputs so far, where its KV lives, and when it stops."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..multimodal.mrope import MRopePositions, prompt_positions
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplingRow
from ..wire.finish_reason import FinishReason
from ..wire.messages import Bootstrap, ImageSpan, ReqOutput, SpecCounts, TokenizedGenerateReq, vocabulary_ids

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64, device="cpu")


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    eos_ids: frozenset[int]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens of fill_ids whose K/V are in the pool; the newest sampled token has none yet
    # The cached prefix this request reads (slots owned by the prefix cache) and the node locking it.
    prefix_indices: torch.Tensor = field(default_factory=lambda: EMPTY_SLOTS)
    last_node: Any = None
    cached_tokens: int = -1  # prefix cache hit at first admission; -1 until admitted
    # Prompt logprobs gathered chunk by chunk; sent once the whole prompt has been computed.
    input_logprob_values: list[float] = field(default_factory=list)
    input_top_values: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs_sent: bool = False
    finish_reason: FinishReason | None = None
    pending: ReqOutput | None = None  # what the next message to the engine will carry
    matcher: Any = None  # grammar state, for constrained requests
    bootstrap: Bootstrap | None = None  # disaggregated serving: where this request's other half is paired
    stream: bool = False  # the engine reads every step's output (see output_due)
    first_output_sent: bool = False
    # Speculative decoding: the drafter's index over this request's tokens, and its acceptance counts.
    draft_state: Any = None
    spec_counts: SpecCounts | None = None
    images: list[ImageSpan] = field(default_factory=list)  # in prompt order

    @classmethod
    def from_tokenized(cls, req: TokenizedGenerateReq, seed: int, eos_ids: frozenset[int]) -> Req:
        return cls(
            rid=req.rid,
            input_ids=req.input_ids,
            params=req.sampling_params,
            seed=req.sampling_params.sampling_seed if req.sampling_params.sampling_seed is not None else seed,
            eos_ids=eos_ids,
            return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num,
            bootstrap=req.bootstrap,
            stream=req.stream,
            images=req.images,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @functools.cached_property
    def prompt_ids(self) -> list[int]:
        """input_ids with image positions as their placeholder token (messages.vocabulary_ids)."""
        return vocabulary_ids(self.input_ids, self.images)

    @functools.cached_property
    def mrope(self) -> MRopePositions | None:
        """Qwen2-VL's M-RoPE positions of this request; None: plain positions (no image of it has a grid)."""
        if not any(image.grid_thw for image in self.images):
            return None
        return prompt_positions(len(self.input_ids), self.images)

    def positions(self, start: int, length: int) -> torch.Tensor:
        """Rotary positions of fill_ids[start : start + length]: [length], or [3, length] where M-RoPE needs it."""
        if self.mrope is None:
            return torch.arange(start, start + length, device="cpu")
        return self.mrope.of(start, length)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end this request once min_new_tokens is met."""
        ids = frozenset(self.params.stop_token_ids)
        return ids if self.params.ignore_eos else ids | self.eos_ids

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose K/V the request needs before it can sample again (a retracted request's outputs
        are recomputed with its prompt)."""
        return self.input_ids + self.output_ids

    def token_ids_with_kv(self) -> list[int]:
        return self.fill_ids[: self.kv_len]

    @property
    def remaining_output(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and not self.input_logprobs_sent

    def input_logprob_rows(self, start: int, length: int) -> range:
        """Positions in [start, start + length) whose logits give a reported prompt logprob (row p predicts p+1)."""
        if not self.wants_input_logprobs:
            return range(0)
        first = max(self.input_logprob_start, 1) - 1
        return range(max(first, start), min(len(self.input_ids) - 1, start + length))

    @property
    def input_logprob_start(self) -> int:
        """First prompt position whose logprob is reported (SGLang: -1 means the last prompt token)."""
        start = self.logprob_start_len if self.logprob_start_len >= 0 else len(self.input_ids) - 1
        return min(start, len(self.input_ids) - 1)

    def sampling_row(self) -> SamplingRow:
        """A snapshot: the sampler may run on another thread while the scheduler appends tokens."""
        return SamplingRow(self.params, self.prompt_ids, list(self.output_ids), self.seed, self.stop_token_ids)

    def output(self) -> ReqOutput:
        if self.pending is None:
            self.pending = ReqOutput(rid=self.rid, new_token_ids=[])
        return self.pending

    def output_due(self) -> ReqOutput | None:
        """Takes the pending output if it goes to the engine now, else None. A streamed request sends each step's
        tokens; one nobody streams sends its first tokens (their arrival is its time to first token) and keeps the
        rest pending until it ends, so its tokens cross the pipe and get decoded once, not every step."""
        if self.pending is None or (self.first_output_sent and not self.stream):
            return None
        out, self.pending = self.pending, None
        self.first_output_sent = True
        return out

    def append_token(self, token: int, decode_tail: Callable[[list[int], bool], str], context_length: int) -> None:
        self.output_ids.append(token)
        self.output().new_token_ids.append(token)
        self.finish_reason = self._check_finished(token, decode_tail, context_length)

    def _check_finished(self, token: int, decode_tail: Callable[[list[int], bool], str],
                        context_length: int) -> FinishReason | None:
        params = self.params
        if len(self.output_ids) >= params.min_new_tokens:
            if token in self.stop_token_ids:
                return FinishReason.stop_token(token)
            if params.stop:
                # A stop string can end inside a multi-token span, so decode a tail long enough to hold any.
                window = max(len(s) for s in params.stop) + 2
                tail = decode_tail(self.output_ids[-window:], params.skip_special_tokens)
                for stop in params.stop:
                    if stop in tail:
                        return FinishReason.stop_string(stop)
            if params.stop_regex:
                # A regex match can span any length, so search the whole output (only requests that ask pay).
                text = decode_tail(self.output_ids, params.skip_special_tokens)
                for pattern in params.stop_regex:
                    match = re.search(pattern, text)
                    if match:
                        return FinishReason.stop_string(match.group(0))
        if len(self.output_ids) >= params.max_new_tokens:
            return FinishReason.length(params.max_new_tokens)
        if len(self.input_ids) + len(self.output_ids) >= context_length:
            return FinishReason.length(len(self.output_ids))
        return None
