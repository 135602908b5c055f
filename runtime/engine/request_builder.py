"""Turns user arguments into validated, tokenized scheduler requests (n > 1 expands into n requests)."""

from __future__ import annotations

import dataclasses
import numbers
import re
import uuid
from typing import Any

from ..multimodal.images import per_prompt_images
from ..multimodal.prompt import ImagePrompts
from ..sampling.params import SamplingParams
from ..wire.messages import Bootstrap, ImageSpan, SchedulerReady, TokenizedGenerateReq

# A DNS name, an IPv4 address or an IPv6 address (bare or in brackets): nothing that could bend the URL.
HOST_PATTERN = re.compile(r"[A-Za-z0-9.\-]+|\[?[0-9A-Fa-f:.]+\]?")
# Requests one call may create (prompts times n): a bound, so no call can queue without limit.
MAX_REQUESTS_PER_CALL = 8192


class RequestBuilder:
    def __init__(self, tokenizer, info: SchedulerReady, images: ImagePrompts | None = None) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.images = images  # a vision-language model's image processing; None: text only

    def build(self, prompt, sampling_params, input_ids, return_logprob: bool, logprob_start_len: int,
              top_logprobs_num: int, rid: str | None, stream: bool, return_text_in_logprobs: bool = False,
              bootstrap: dict[str, Any] | None = None,
              image_data: Any = None) -> tuple[list[TokenizedGenerateReq], bool]:
        """Returns the requests and whether the input was a single prompt. Raises ValueError on bad input."""
        _check_flags(return_logprob=return_logprob, stream=stream, return_text_in_logprobs=return_text_in_logprobs)
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError(f"rid must be a non-empty string, got {rid!r}")
        if top_logprobs_num and not return_logprob:
            raise ValueError("top_logprobs_num needs return_logprob=True")
        prompts, single = self._token_lists(prompt, input_ids)
        prompts, images = self._with_images(prompts, image_data, single)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        _check_logprob_args(logprob_start_len, top_logprobs_num)
        if stream and (len(prompts) != 1 or params_list[0].n != 1):
            raise ValueError("stream=True takes a single prompt with n=1")
        paired = self._bootstrap(bootstrap, len(prompts) == 1 and params_list[0].n == 1, params_list[0])
        total = sum(p.n for p in params_list)
        if total > MAX_REQUESTS_PER_CALL:
            raise ValueError(f"one call may create at most {MAX_REQUESTS_PER_CALL} requests (prompts times n), "
                             f"got {total}")
        base_rid = rid or uuid.uuid4().hex
        reqs = []
        for index, (ids, params) in enumerate(zip(prompts, params_list)):
            where = "" if single else f"prompt {index}: "
            try:
                self._check_fits(ids, params, logprob_start_len)
            except ValueError as error:
                raise ValueError(f"{where}{error}") from None
            for sample in range(params.n):
                one = dataclasses.replace(params, n=1)
                if params.n > 1 and params.sampling_seed is not None:
                    one.sampling_seed = params.sampling_seed + sample
                request_id = base_rid if single and params.n == 1 else f"{base_rid}-{index}-{sample}"
                reqs.append(TokenizedGenerateReq(request_id, ids, one, return_logprob, logprob_start_len,
                                                 top_logprobs_num, paired, stream, images[index]))
        return reqs, single and params_list[0].n == 1

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

    def _bootstrap(self, fields: dict[str, Any] | None, one_request: bool, params: SamplingParams) -> Bootstrap | None:
        """Disaggregated servers need, per request, where its other half pairs up (sglang-router adds it)."""
        mode = self.info.disaggregation_mode
        given = {k: v for k, v in (fields or {}).items() if v is not None}
        if mode == "null":
            if given:
                raise ValueError(f"{', '.join(sorted(given))}: bootstrap fields are for prefill and decode servers "
                                 f"(disaggregation_mode prefill or decode); this server serves requests whole")
            return None
        missing = [k for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if k not in given]
        if missing:
            raise ValueError(f"this is a {mode} server of a prefill/decode pair: every request needs bootstrap_host, "
                             f"bootstrap_port and bootstrap_room (sglang-router --pd-disaggregation adds them); "
                             f"missing {', '.join(missing)}")
        host, port, room = given["bootstrap_host"], given["bootstrap_port"], given["bootstrap_room"]
        if not isinstance(host, str) or len(host) > 255 or not HOST_PATTERN.fullmatch(host):
            raise ValueError(f"bootstrap_host must be a host name or address, got {host!r}")
        if not _is_token_id(port) or not 1 <= port <= 65535:
            raise ValueError(f"bootstrap_port must be an integer in [1, 65535], got {port!r}")
        if not _is_token_id(room) or not 0 <= room < 2**64:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**64), got {room!r}")
        if not one_request:
            raise ValueError("a bootstrap_room pairs one request: send a single prompt with n=1")
        if params.max_new_tokens < 1:
            raise ValueError("disaggregated serving needs max_new_tokens >= 1: the prefill server samples the "
                             "first token")
        return Bootstrap(host, int(port), int(room))

    def _token_lists(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt (text) or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            if not single and not isinstance(prompt, (list, tuple)):
                raise ValueError(f"prompt must be a string or a non-empty list of strings, got "
                                 f"{type(prompt).__name__}")
            texts = [prompt] if single else list(prompt)
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            for index, text in enumerate(texts):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as error:
                    raise ValueError(f"prompt {'' if single else index} is not valid text: {error.reason} at "
                                     f"position {error.start}") from None
            for index, text in enumerate(texts):
                if not text:
                    raise ValueError("prompt is empty" if single else f"prompt {index} is empty")
            return [self.tokenizer.encode(t) for t in texts], single
        if not isinstance(input_ids, (list, tuple)):
            raise ValueError(f"input_ids must be a list of token ids or a list of such lists, got "
                             f"{type(input_ids).__name__}")
        single = bool(input_ids) and all(_is_token_id(t) for t in input_ids)
        lists = [input_ids] if single else list(input_ids or [])
        if not lists or not all(isinstance(ids, (list, tuple)) and ids for ids in lists):
            raise ValueError("input_ids must be a non-empty list of token ids or a list of such lists")
        for ids in lists:
            bad = [t for t in ids if not _is_token_id(t) or not 0 <= t < self.info.vocab_size]
            if bad:
                raise ValueError(f"input_ids has ids outside the vocabulary (size {self.info.vocab_size}): {bad[:5]}")
        return [[int(t) for t in ids] for ids in lists], single

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

    def _check_fits(self, ids: list[int], params: SamplingParams, logprob_start_len: int) -> None:
        if logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len={logprob_start_len} is past the prompt's last token (the prompt has "
                             f"{len(ids)} tokens)")
        limit = self.info.max_req_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the limit is {limit - 1} (context length "
                             f"{self.info.context_length}, KV pool {self.info.max_total_tokens} tokens)")
        if len(ids) + params.max_new_tokens > limit:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"the limit of {limit} tokens")


def _check_logprob_args(logprob_start_len: Any, top_logprobs_num: Any) -> None:
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < -1:
        raise ValueError(f"logprob_start_len must be an integer >= -1, got {logprob_start_len!r}")
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")


def _is_token_id(value: Any) -> bool:
    """Python and numpy integers, not bools (True is not token 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
