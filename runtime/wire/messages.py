"""Messages between the engine (tokenizer side) and the scheduler process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling.params import SamplingParams
from .finish_reason import FinishReason

# A logprob entry as SGLang's native API returns it: (logprob or None, token id, token text or None).
LogprobTriple = tuple[float | None, int, str | None]


@dataclass(frozen=True)
class Bootstrap:
    """Disaggregated serving: the prefill server's bootstrap service and the room pairing the two halves."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: its tokens are input_ids[offset : offset + length], each holding `pad_id`, a value
    past the vocabulary derived from the image's hash (so the radix cache shares a prefix only with the same
    image), whose embeddings come from encoding `pixel_values` (the model's image processor's output). Qwen2-VL's
    pixel values are the image's flattened patches, laid out on `grid_thw`, which also gives its M-RoPE positions."""

    digest: str
    offset: int
    length: int
    pad_id: int
    token_id: int  # the model's image placeholder id: what logprobs and penalties see at those positions
    pixel_values: Any  # numpy float32: LLaVA [3, H, W]; Qwen2-VL [patches, 3 * temporal * patch^2]
    grid_thw: tuple[int, int, int] | None = None  # Qwen2-VL: the patch grid (temporal, height, width)
    merge_size: int = 1  # Qwen2-VL: patches merged into one token along height and width

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImagePiece:
    """The part of an image a forward computes: the image's tokens `tokens` sit at packed rows `rows` (a prefill
    chunk or a cached prefix may cut an image anywhere)."""

    image: ImageSpan
    rows: range
    tokens: range


def vocabulary_ids(input_ids: list[int], images: list[ImageSpan]) -> list[int]:
    """The prompt as the model's vocabulary sees it: an image's positions hold its placeholder token (what
    logprobs report and penalties count there), not the hash pads the radix cache keys on."""
    if not images:
        return input_ids
    ids = list(input_ids)
    for image in images:
        ids[image.offset : image.end] = [image.token_id] * image.length
    return ids


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    # First prompt position whose logprob is returned; -1 means the last prompt token only.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    bootstrap: Bootstrap | None = None
    # A streamed request's outputs go to the engine every step; one nobody streams sends its first tokens (they
    # time the first token) and then everything else once, when it ends.
    stream: bool = False
    images: list[ImageSpan] = field(default_factory=list)


@dataclass
class AbortReq:
    rid: str


@dataclass
class RpcReq:
    """A control call answered with one RpcOut: `call` is one of control_calls.py's or weight_messages.py's types,
    which says what is asked and carries its typed arguments."""

    call: Any
    call_id: int


@dataclass(frozen=True)
class ControlResult:
    """SGLang's reply to a control call: {"success": bool, "message": str}."""

    success: bool
    message: str = ""


@dataclass
class RpcOut:
    call_id: int
    result: Any


@dataclass
class SpecCounts:
    """Speculative decoding, one request's totals so far: verify steps (forwards that checked drafts), tokens
    drafted, and drafts accepted."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def meta(self) -> dict[str, float | int]:
        """SGLang's meta_info keys; accept_length counts the tokens of a verify step, the one after its accepted
        drafts included."""
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_draft_token_num": self.draft_tokens,
            "spec_accept_token_num": self.accepted_tokens,
            "spec_accept_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "spec_accept_length": 1 + self.accepted_tokens / self.verify_ct if self.verify_ct else 0.0,
        }


@dataclass
class ReqOutput:
    """What a request produced since its last output (one step, or for a request nobody streams, everything after
    its first tokens); logprob lists hold only those new entries."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_logprob_start: int = 0
    spec: SpecCounts | None = None  # speculative decoding on: the request's totals when this output was sent
    weight_version: str | None = None  # the weights this output's tokens were sampled with


@dataclass
class LoadReport:
    """The scheduler's counters (GetStats) after a step, sent ahead of that step's outputs when they changed: the
    engine answers /get_load and /metrics from the latest one without waiting for a busy scheduler."""

    counters: dict[str, Any]


@dataclass
class SchedulerReady:
    """First message from the scheduler process: facts the engine needs to validate requests."""

    max_total_tokens: int
    max_req_len: int
    context_length: int
    vocab_size: int
    dtype: str = "float32"  # what dtype="auto" resolved to
    quantized_layers: int = 0  # linear layers running on quantized kernels
    quantized_max_rows: int = 0  # for forwards of up to this many rows (-1: every forward); measured (auto)
    disaggregation_mode: str = "null"
    tp_size: int = 1  # processes the model is split over (tensor parallelism)
    load: dict[str, Any] = field(default_factory=dict)  # the counters before any request (then LoadReport's)


class PeerServerError(RuntimeError):
    """A server this request depended on failed it (disaggregated serving: the prefill server or the KV transfer);
    the HTTP server answers 502."""


@dataclass
class SchedulerError:
    """The scheduler process failed to start or crashed; the engine surfaces this text."""

    message: str
