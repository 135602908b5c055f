"""Engine arguments: one dataclass, named after SGLang's server arguments where one exists."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
from dataclasses import dataclass

from ..grammars.registry import BACKENDS as GRAMMAR_BACKENDS
from . import registry
from .attention.select import resolve_attention_backend
from .disaggregation.registry import MODE as DISAGGREGATION_MODE
from .disaggregation.registry import NULL as NO_DISAGGREGATION
from .disaggregation.registry import TRANSFER_BACKEND as DISAGGREGATION_TRANSFER_BACKEND
from .speculative.registry import KIND as SPECULATIVE_ALGORITHM
from .speculative.registry import STANDALONE
from .tools.formats import PARSER_NAMES
from .tools.reasoning import FORMATS as REASONING_FORMATS

MAX_DP_SIZE = 64
MAX_TP_SIZE = 8
# Speculative decoding's bounds: a verify forward computes 1 + speculative_num_draft_tokens rows per request.
MAX_DRAFT_TOKENS = 64
MAX_NGRAM_WINDOW = 64
# Named choices, each kind under the field that picks from it. Pluggable parts register beside their implementations:
# attention backends in attention/select.py, speculative algorithms in speculative/registry.py, disaggregation sides
# and transfer backends in disaggregation/registry.py; grammar backends are listed in grammars/registry.py.
registry.register_names("dtype", ("auto", "float32", "bfloat16", "float16"))
registry.register_names("quantization", ("auto", "none", "gguf"))
registry.register_names("schedule_policy", ("lpm", "dfs-weight", "fcfs", "lof", "random"))
registry.register_names("grammar_backend", GRAMMAR_BACKENDS)
registry.register_names("router_policy", ("cache_aware", "round_robin", "power_of_two", "random"))
registry.register_names("tool_call_parser", PARSER_NAMES)
registry.register_names("reasoning_parser", (*REASONING_FORMATS, "none"))
registry.register_names("packed_linear", ("auto", "on", "off"))
registry.register_names("dense_gemv", ("auto", "on", "off"))
ENGINE_CHOICE_FIELDS = ("dtype", "quantization", "schedule_policy", "grammar_backend", DISAGGREGATION_MODE,
                        DISAGGREGATION_TRANSFER_BACKEND, "packed_linear", "dense_gemv")
# The CPU kernel switches: each field's environment variable, which overrides the field where it is set (0 or 1).
KERNEL_SWITCHES = {"paged_attention_kernel": "FURCATE_PAGED_ATTENTION",
                   "fused_elementwise_kernel": "FURCATE_FUSED_ELEMENTWISE", "block_gemv_kernel": "FURCATE_BLOCK_GEMV",
                   "native_ops": "FURCATE_NATIVE_OPS", "huge_pages": "FURCATE_HUGE_PAGES",
                   "packed_linear": "FURCATE_PACKED_LINEAR", "dense_gemv": "FURCATE_DENSE_GEMV"}
# What a switch sets its variable to; the defaults (True, "auto") leave it unset, as the kernels' own defaults are.
SWITCH_VALUES = {False: "0", "off": "0", "on": "1"}
PATH_FIELDS = ("model_path", "tokenizer_path", "speculative_draft_model_path")


def path_text(name: str, value: object) -> str | None:
    """A path field as text: str or os.PathLike taken, anything else refused by name."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fsdecode(value)
    raise ValueError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")


@dataclass
class EngineArgs:
    """Everything the engine and scheduler need to start; picklable so it can cross processes."""

    # An HF model directory (config.json + safetensors) or a GGUF file; "default" is the embedded SmolLM2-135M.
    model_path: str = "default"
    # Where the tokenizer lives, when not beside the model.
    tokenizer_path: str | None = None
    # Weights and KV cache precision; auto: on CUDA bfloat16 (float16 for a float16 checkpoint); on CPU bfloat16
    # where it is native (avx512_bf16, AMX) or for a bfloat16 checkpoint, float32 otherwise.
    dtype: str = "auto"
    # Weight-only quantization of a model given as a GGUF file (including the default model): gguf runs its
    # Q4_0/Q4_1/Q8_0 tensors on torch's int4/int8 CPU kernels (least memory); auto runs those kernels for the
    # batch sizes where they measured faster than dense weights on this CPU at start-up, dense weights above
    # (runtime/model/kernel_choice.py); none dequantizes every weight to dtype. The kernels are the CPU's: on CUDA
    # auto means none.
    quantization: str = "auto"
    # The torch device the model runs on; auto: CUDA when torch sees a CUDA device, else the CPU.
    device: str = "auto"
    # Tensor parallelism: the model's heads, MLP columns and vocabulary split over this many processes (gloo on
    # CPU, NCCL on GPU); the scheduler process is rank 0. Runs dense weights (quantization auto means none).
    tp_size: int = 1
    # Longest prompt plus output per request; defaults to the model's own limit.
    context_length: int | None = None
    # Memory: an explicit token count wins over the fraction of free RAM.
    max_total_tokens: int | None = None
    # When max_total_tokens is not set: on CPU the share of free RAM given to the KV cache (default 0.2); on a GPU
    # the share of its memory for weights and KV cache together (default 0.85, SGLang's meaning).
    mem_fraction_static: float | None = None
    # Requests decoding at once (the continuous batch's size limit).
    max_running_requests: int = 128
    # Requests allowed to wait beyond the running batch; a new one past that is refused at once (the server
    # answers 503) instead of queueing without bound. None: no limit.
    max_queued_requests: int | None = None
    # New requests the engine holds for a scheduler busy in a forward step (it reads between steps); past that a new
    # request is refused at once (the server answers 503 with Retry-After) instead of blocking its caller.
    max_pending_requests: int = 1024
    # Prompt tokens prefilled in one step, over all requests admitted together.
    max_prefill_tokens: int = 16384
    # Prompts longer than this are prefilled in chunks, one per step, while decoding continues; -1 disables.
    chunked_prefill_size: int = 2048
    # Run a prefill chunk and the decoding requests in one forward.
    enable_mixed_chunk: bool = False
    # Order of waiting requests: lpm = longest cached prefix first.
    schedule_policy: str = "lpm"
    # Free every request's KV at its end instead of caching shared prefixes.
    disable_radix_cache: bool = False
    # The overlapped loop (forward on a worker thread) is off on CPU: on 2 cores the scheduler thread takes a core
    # from torch's. Measured on the default model: plain loop with 2 torch threads 44.6 tok/s batch-1 decode and
    # 124 tok/s offline; overlap with 2 threads 29.2 / 103; overlap with 1 thread 39.4 / 87.
    disable_overlap_schedule: bool = True
    # Constrained decoding library for json_schema / regex / ebnf / choices; auto picks, per spec, the fastest one
    # that enforces it exactly (grammars/auto.py) and fails a request none does unless it sets
    # allow_approximate_schema.
    grammar_backend: str = "auto"
    # A grammar still compiling this many seconds after its compile began fails its request (others are never
    # held up); outlines-core compiles are killed then.
    grammar_compile_timeout: float = 30.0
    # Jump-forward appends the tokens a grammar forces (e.g. `{"name": "`) without sampling them one by one.
    # On by default: benchmarks/structured.py measured it faster at batch 1 and 16.
    disable_jump_forward: bool = False
    # Share of a request's remaining max_new_tokens reserved at admission; it decays towards the minimum
    # while memory lasts and jumps back up after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.14
    new_token_ratio_decay_steps: int = 600
    # Attention implementation; auto: flashinfer on CUDA when installed, triton on CUDA without it, torch_native
    # elsewhere (only backends this build has are picked).
    attention_backend: str = "auto"
    # CUDA devices: decode batches replay CUDA graphs captured for a ladder of batch sizes
    # (runtime/executor/cuda_graph.py) unless disabled; batches above the largest captured size run eagerly. Needs an
    # attention backend with fixed metadata buffers (flashinfer, triton); not under tensor parallelism.
    disable_cuda_graph: bool = False
    # Largest decode batch captured; None: 256 (never more than max_running_requests).
    cuda_graph_max_bs: int | None = None
    # CPU: decode batches of up to torch_compile_max_bs requests run as one torch.compile'd graph per batch-size
    # class (runtime/executor/compiled_decode.py), saved on disk once compiled, so later starts load them in seconds.
    # Unset: a start that finds no saved graphs decodes eagerly while a low-priority process builds them (for the
    # default model on 2 cores ~2 min; it stops with the engine), then switches to them
    # (runtime/executor/graph_builder.py); `furcate prepare` builds them ahead of time. True: compile at start-up
    # instead (~100 s the first time). False: steps always run eagerly. Not under tensor parallelism nor with
    # sliding-window layers.
    enable_torch_compile: bool | None = None
    torch_compile_max_bs: int = 32
    # CPU kernels (docs/engine.md, "CPU kernel switches"), each on where it builds and pays; off keeps torch's path.
    # The environment variable of each (FURCATE_PAGED_ATTENTION, ...), set to 0 or 1, overrides the argument.
    # Attention read straight from the paged KV pool (C kernel), float32 and bfloat16 CPU batches.
    paged_attention_kernel: bool = True
    # RMSNorm, the SiLU-gated product and rotary in one pass each (C kernel), eager CPU forwards.
    fused_elementwise_kernel: bool = True
    # GGUF 4-bit and 8-bit weights through the block GEMV kernel (C); off: torch's int4 / int8 kernels.
    block_gemv_kernel: bool = True
    # The C++ kernels of furcate's torch ops (a compiled graph calls them without a trip into Python); off: their
    # Python kernels, with the same results.
    native_ops: bool = True
    # Large CPU tensors (KV pool, weights) on transparent huge pages.
    huge_pages: bool = True
    # CPU linears through oneDNN with weights reordered once: auto packs bfloat16 always and float32 where measured
    # faster; on packs float32 too, from one row, without measuring; off packs nothing.
    packed_linear: str = "auto"
    # One-row linears through the dense GEMV: auto where measured faster than the packed copy; on wherever it takes
    # the shape; off never.
    dense_gemv: str = "auto"
    # Seed of the scheduler's sampling generator (requests may carry their own sampling_seed).
    random_seed: int = 0
    # torch threads in the scheduler process (and in each tensor-parallel rank); defaults to every core, shared
    # evenly by the tensor-parallel ranks.
    torch_num_threads: int | None = None
    # Logging level of the scheduler process.
    log_level: str = "warning"
    # Prefill/decode disaggregation behind sglang-router's --pd-disaggregation: a prefill server computes prompts
    # and sends their K/V and first token to the decode server that continues the request; null serves whole.
    disaggregation_mode: str = NO_DISAGGREGATION
    # The engine that moves K/V between the two: mooncake (Mooncake's TransferEngine over TCP) or nixl.
    disaggregation_transfer_backend: str = "mooncake"
    # Prefill servers: the port of the bootstrap service where decode servers claim requests' K/V.
    disaggregation_bootstrap_port: int = 8998
    # The address this server's transfer engine and bootstrap service use; peers must reach it.
    disaggregation_host: str = "127.0.0.1"
    # Seconds a request's two halves wait for each other (queueing included) before it fails.
    disaggregation_timeout: float = 300.0
    # Speculative decoding (SGLang's names): NGRAM drafts each decoding request's next tokens from its own prompt
    # and output (prompt lookup: what followed the latest earlier occurrence of its last n tokens), STANDALONE with
    # a small draft model's greedy tokens (speculative_draft_model_path); one forward verifies them. Greedy output
    # is unchanged, sampled output keeps its distribution. None: off. Runs on the plain loop only
    # (disable_overlap_schedule).
    speculative_algorithm: str | None = None
    # Draft tokens proposed per request and step (the verify forward computes this many more rows per request).
    speculative_num_draft_tokens: int = 4
    # The n-gram lengths matched against earlier text, longest first; a shorter match drafts more often and worse.
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 4
    # STANDALONE: the draft model, an HF model directory or a GGUF file ("default": the embedded model) with the
    # target's vocabulary. It runs in the engine's dtype, on its own KV pool (never the prefix cache).
    speculative_draft_model_path: str | None = None
    # The draft model's quantization (choices as quantization's); None: the target's.
    speculative_draft_model_quantization: str | None = None
    # KV slots of the draft model's pool; None: as many as the target's. A request the pool has no room for
    # drafts nothing that step.
    speculative_draft_max_total_tokens: int | None = None
    # Images (vision-language models): decoded pixels allowed per image, images per request, and whether http(s)
    # image URLs are fetched (off by default: a server must not fetch arbitrary addresses; on, with a size and a
    # time limit). Local file paths are read by the Engine; the HTTP server reads them only from data: URLs.
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 16
    allow_remote_images: bool = False

    def __post_init__(self) -> None:
        for name in PATH_FIELDS:  # a pathlib.Path works here as in from_pretrained
            setattr(self, name, path_text(name, getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        for name in ENGINE_CHOICE_FIELDS:
            registry.check(name, getattr(self, name))
        if self.attention_backend != "auto":  # auto always resolves; resolving it on device auto imports torch
            resolve_attention_backend(self.attention_backend, self.device)
        if not 1 <= self.tp_size <= MAX_TP_SIZE:
            raise ValueError(f"tp_size must be in [1, {MAX_TP_SIZE}], got {self.tp_size}")
        if self.tp_size > 1 and self.quantization == "gguf":
            raise ValueError("quantization='gguf' does not support tp_size > 1 (the quantized kernels hold whole "
                             "tensors); use quantization='none' or 'auto', which run dense weights under tensor "
                             "parallelism")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.enable_torch_compile is not None and not isinstance(self.enable_torch_compile, bool):
            raise ValueError(f"enable_torch_compile must be True, False or None (unset), got "
                             f"{self.enable_torch_compile!r}")
        check_count("torch_compile_max_bs", self.torch_compile_max_bs)
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        check_count("max_pending_requests", self.max_pending_requests)
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be -1 (off) or >= 1, got {self.chunked_prefill_size}")
        for name in KERNEL_SWITCHES:
            if not registry.is_kind(name) and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._validate_disaggregation()
        self._validate_speculative()
        for name in ("max_image_pixels", "max_images_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got "
                             f"{self.min_new_token_ratio} and {self.init_new_token_ratio}")

    def _validate_disaggregation(self) -> None:
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError(f"disaggregation_bootstrap_port must be in [1, 65535], got "
                             f"{self.disaggregation_bootstrap_port}")
        if self.disaggregation_mode != NO_DISAGGREGATION and self.tp_size > 1:
            raise ValueError("disaggregation_mode prefill/decode does not support tp_size > 1 yet: the KV transfer "
                             "moves one process's KV pool")
        if not 0 < self.disaggregation_timeout < float("inf"):
            raise ValueError(f"disaggregation_timeout must be a positive number of seconds, got "
                             f"{self.disaggregation_timeout}")

    def _validate_speculative(self) -> None:
        if self.speculative_algorithm is not None:
            registry.check(SPECULATIVE_ALGORITHM, self.speculative_algorithm)
            if not self.disable_overlap_schedule:
                # The overlap loop's token table holds one token in flight per request; a verify step yields several.
                raise ValueError("speculative_algorithm runs on the plain loop only; set disable_overlap_schedule=True")
        bounded = (("speculative_num_draft_tokens", MAX_DRAFT_TOKENS),
                   ("speculative_ngram_min_match_window_size", MAX_NGRAM_WINDOW),
                   ("speculative_ngram_max_match_window_size", MAX_NGRAM_WINDOW))
        for name, most in bounded:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ValueError(f"{name} must be an integer in [1, {most}], got {value!r}")
        low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if low > high:
            raise ValueError("speculative_ngram_min_match_window_size must be <= "
                             f"speculative_ngram_max_match_window_size, got {low} and {high}")
        self._validate_draft_model()

    def _validate_draft_model(self) -> None:
        """The STANDALONE fields (the draft model itself is checked before it loads: speculative/draft_check.py)."""
        path = self.speculative_draft_model_path
        standalone = self.speculative_algorithm == STANDALONE
        if standalone and (not isinstance(path, str) or not path):
            raise ValueError("speculative_algorithm='STANDALONE' needs speculative_draft_model_path (an HF model "
                             f"directory or a GGUF file), got {path!r}")
        if not standalone and path is not None:
            raise ValueError("speculative_draft_model_path is used only with speculative_algorithm='STANDALONE', got "
                             f"speculative_algorithm={self.speculative_algorithm!r}")
        quantization = self.speculative_draft_model_quantization
        if quantization is not None and quantization not in registry.names("quantization"):
            raise ValueError(f"speculative_draft_model_quantization must be None or one of "
                             f"{registry.names('quantization')}, got {quantization!r}")
        size = self.speculative_draft_max_total_tokens
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 16):
            raise ValueError(f"speculative_draft_max_total_tokens must be an integer >= 16, got {size!r}")

    @property
    def draft_quantization(self) -> str:
        return self.speculative_draft_model_quantization or self.quantization

    def kernel_environment(self) -> dict[str, str]:
        """The kernel switches as the variables the kernels read, where the environment does not set them already
        (the scheduler process applies these before any kernel loads, and its children inherit them)."""
        values = {variable: SWITCH_VALUES.get(getattr(self, name)) for name, variable in KERNEL_SWITCHES.items()}
        return {variable: value for variable, value in values.items()
                if value is not None and variable not in os.environ}

    @property
    def num_threads(self) -> int:
        return self.torch_num_threads or max(1, (os.cpu_count() or 1) // self.tp_size)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(cls, parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return from_cli_args(cls, args)


@dataclass
class ServerArgs:
    """How `furcate serve` listens; the engine's own arguments stay in EngineArgs."""

    # Interface to listen on; the loopback default keeps the server private to this machine.
    host: str = "127.0.0.1"
    # TCP port; 0 picks a free one (the ready line prints the URL actually bound).
    port: int = 30000
    # When set, every route except /health and /health_generate needs `Authorization: Bearer KEY`.
    api_key: str | None = None
    # The model name the OpenAI routes report and accept; defaults to the model path.
    served_model_name: str | None = None
    # Largest request body accepted, in bytes; a bigger one is answered 413.
    max_request_bytes: int = 16 * 1024 * 1024
    # Seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted.
    graceful_shutdown_timeout: float = 10.0
    # Data parallelism: this many servers on free loopback ports behind one sglang-router listening on host:port.
    dp_size: int = 1
    # The router's policy when dp_size > 1.
    router_policy: str = "cache_aware"
    # Prefill/decode disaggregation in one command: dp_size prefill and dp_size decode servers on free loopback
    # ports behind sglang-router in PD mode (K/V moved by disaggregation_transfer_backend).
    pd_disaggregation: bool = False
    # Image strings that name files on this machine are read (vision-language models); off, a client could have
    # the server open any path. Data: URLs and base64 are always read; http(s) URLs with allow_remote_images.
    allow_local_images: bool = False
    # The format tool calls are generated and parsed in (tool_choice auto needs one); unset: detected from the
    # chat template (Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], pythonic).
    tool_call_parser: str | None = None
    # How reasoning is told apart from the answer (reasoning_content); unset: detected from the chat template
    # (qwen3 where it switches enable_thinking, deepseek-r1 for other think blocks); none: never.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not 1 <= self.dp_size <= MAX_DP_SIZE:  # each replica is a server and a scheduler process
            raise ValueError(f"dp_size must be in [1, {MAX_DP_SIZE}], got {self.dp_size}")
        if (self.dp_size > 1 or self.pd_disaggregation) and self.api_key is not None:
            # sglang-router's --api-key authenticates it to workers; checking clients' keys is not wired up yet.
            raise ValueError("api_key with dp_size > 1 or pd_disaggregation is not supported yet")
        registry.check("router_policy", self.router_policy)
        for kind in ("tool_call_parser", "reasoning_parser"):
            if getattr(self, kind) is not None:
                registry.check(kind, getattr(self, kind))
        if not 0 <= self.graceful_shutdown_timeout < float("inf"):
            raise ValueError(f"graceful_shutdown_timeout must be a finite number >= 0, got "
                             f"{self.graceful_shutdown_timeout}")


def add_dataclass_args(cls: type, parser: argparse.ArgumentParser) -> None:
    """Expose every field as `--field-name` (SGLang's flag names), typed from its annotation, booleans as
    `--flag/--no-flag`, named choices listed, help from the comment above the field."""
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{comments.get(f.name, '')} (default: {f.default})".strip().replace("%", "%%")
        if f.type in ("bool", "bool | None"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        kind = int if "int" in f.type else float if "float" in f.type else str
        named = registry.is_kind(f.name)
        parser.add_argument(flag, type=kind, default=f.default, choices=registry.names(f.name) if named else None,
                            help=help_text, metavar=None if named else kind.__name__.upper())


def from_cli_args(cls: type, args: argparse.Namespace):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def _field_comments(cls: type) -> dict[str, str]:
    """The `#` comment lines right above each field of a dataclass, joined: the CLI's help text."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
        elif ":" in stripped and not stripped.startswith(("def ", "@", '"', "class ")):
            comments[stripped.split(":", 1)[0]] = " ".join(pending)
            pending = []
        else:
            pending = []
    return comments


def check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
