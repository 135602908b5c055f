"""Turns a checked generate call into tokenized scheduler requests, with the checks that need the model or the
server: vocabulary, context length, images, sampling parameters, disaggregation (n > 1 expands into n requests)."""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any

from ..multimodal.images import per_prompt_images
from ..multimodal.prompt import ImagePrompts
from ..sampling.params import SamplingParams
from ..wire.messages import Bootstrap, ImageSpan, SchedulerReady, TokenizedGenerateReq
from .generate_request import (
    BOOTSTRAP_KEYWORDS,
    MAX_REQUESTS_PER_CALL,
    BootstrapFields,
    GenerateRequest,
    is_token_id,
)

# A DNS name, an IPv4 address or an IPv6 address (bare or in brackets): nothing that could bend the URL.
HOST_PATTERN = re.compile(r"[A-Za-z0-9.\-]+|\[?[0-9A-Fa-f:.]+\]?")


class RequestBuilder:
    def __init__(self, tokenizer, info: SchedulerReady, images: ImagePrompts | None = None) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.images = images  # a vision-language model's image processing; None: text only

    def build(self, call: GenerateRequest) -> tuple[list[TokenizedGenerateReq], bool]:
        """The scheduler requests of one checked call, and whether it returns one result (a single prompt with
        n=1) rather than a list. Raises ValueError on input this model or server cannot take."""
        prompts, images = self._with_images(self._token_lists(call), call.image_data, call.single)
        params_list = self._params_per_prompt(call.sampling_params, len(prompts))
        one_request = len(prompts) == 1 and params_list[0].n == 1
        if call.stream and not one_request:
            raise ValueError("stream=True takes a single prompt with n=1")
        paired = self._bootstrap(call.bootstrap, one_request, params_list[0])
        total = sum(p.n for p in params_list)
        if total > MAX_REQUESTS_PER_CALL:
            raise ValueError(f"one call may create at most {MAX_REQUESTS_PER_CALL} requests (prompts times n), "
                             f"got {total}")
        base_rid = call.rid or uuid.uuid4().hex
        reqs = []
        for index, (ids, params) in enumerate(zip(prompts, params_list)):
            self._check_fits(ids, params, call.logprob_start_len, "" if call.single else f"prompt {index}: ")
            reqs += [TokenizedGenerateReq(rid, ids, one, call.return_logprob, call.logprob_start_len,
                                          call.top_logprobs_num, paired, call.stream, images[index])
                     for rid, one in _samples(base_rid, index, params, call.single)]
        return reqs, call.single and params_list[0].n == 1

    def _with_images(self, prompts: list[list[int]], image_data: Any,
                     single: bool) -> tuple[list[list[int]], list[list[ImageSpan]]]:
        """Each prompt with its images' tokens in place of their placeholders, and its images."""
        if image_data is None:
            return prompts, [[] for _ in prompts]
        if self.images is None:
            raise ValueError("image_data needs a vision-language model; the served model reads text only")
        per_prompt = per_prompt_images(image_data, len(prompts))
        expanded, spans = [], []
        for index, (ids, items) in enumerate(zip(prompts, per_prompt)):
            try:
                with_images, images = self.images.expand(ids, items) if items else (ids, [])
            except ValueError as error:
                raise ValueError(f"{'' if single else f'prompt {index}: '}{error}") from None
            expanded.append(with_images)
            spans.append(images)
        return expanded, spans

    def _bootstrap(self, fields: BootstrapFields | None, one_request: bool,
                   params: SamplingParams) -> Bootstrap | None:
        """Disaggregated servers need, per request, where its other half pairs up (sglang-router adds it)."""
        mode = self.info.disaggregation_mode
        given = {} if fields is None else fields.given()
        if mode == "null":
            if given:
                raise ValueError(f"{', '.join(sorted(given))}: bootstrap fields are for prefill and decode servers "
                                 f"(disaggregation_mode prefill or decode); this server serves requests whole")
            return None
        missing = [k for k in BOOTSTRAP_KEYWORDS if k not in given]
        if missing:
            raise ValueError(f"this is a {mode} server of a prefill/decode pair: every request needs bootstrap_host, "
                             f"bootstrap_port and bootstrap_room (sglang-router --pd-disaggregation adds them); "
                             f"missing {', '.join(missing)}")
        host, port, room = given["bootstrap_host"], given["bootstrap_port"], given["bootstrap_room"]
        if not isinstance(host, str) or len(host) > 255 or not HOST_PATTERN.fullmatch(host):
            raise ValueError(f"bootstrap_host must be a host name or address, got {host!r}")
        if not is_token_id(port) or not 1 <= port <= 65535:
            raise ValueError(f"bootstrap_port must be an integer in [1, 65535], got {port!r}")
        if not is_token_id(room) or not 0 <= room < 2**64:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**64), got {room!r}")
        if not one_request:
            raise ValueError("a bootstrap_room pairs one request: send a single prompt with n=1")
        if params.max_new_tokens < 1:
            raise ValueError("disaggregated serving needs max_new_tokens >= 1: the prefill server samples the "
                             "first token")
        return Bootstrap(host, int(port), int(room))

    def _token_lists(self, call: GenerateRequest) -> list[list[int]]:
        if call.token_ids is None:  # text prompts
            return [self.tokenizer.encode(text) for text in call.texts or ()]
        vocab_size = self.info.vocab_size
        for ids in call.token_ids:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"input_ids has ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
        return [list(ids) for ids in call.token_ids]

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != count:
                raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
            raw_list: list[Any] = sampling_params
        else:
            raw_list = [sampling_params] * count
        params = [SamplingParams.from_dict(raw) for raw in raw_list]
        for p in params:
            p.check_vocab(self.info.vocab_size)
        return params

    def _check_fits(self, ids: list[int], params: SamplingParams, logprob_start_len: int, where: str) -> None:
        """`where` names the prompt in a list ("prompt 2: "); empty for a single one."""
        limit = self.info.max_req_len
        if logprob_start_len >= len(ids):
            problem = (f"logprob_start_len={logprob_start_len} is past the prompt's last token (the prompt has "
                       f"{len(ids)} tokens)")
        elif len(ids) >= limit:
            problem = (f"prompt has {len(ids)} tokens; the limit is {limit - 1} (context length "
                       f"{self.info.context_length}, KV pool {self.info.max_total_tokens} tokens)")
        elif len(ids) + params.max_new_tokens > limit:
            problem = (f"max_new_tokens={params.max_new_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                       f"limit of {limit} tokens")
        else:
            return
        raise ValueError(f"{where}{problem}")


def _samples(base_rid: str, index: int, params: SamplingParams, single: bool) -> list[tuple[str, SamplingParams]]:
    """A prompt's n samples, each its own request: rid `base-index-sample` unless the call is one request, seeds
    counted up from the prompt's sampling_seed so the samples differ yet repeat."""
    samples = []
    for sample in range(params.n):
        one = dataclasses.replace(params, n=1)
        if params.n > 1 and params.sampling_seed is not None:
            one.sampling_seed = params.sampling_seed + sample
        samples.append((base_rid if single and params.n == 1 else f"{base_rid}-{index}-{sample}", one))
    return samples
