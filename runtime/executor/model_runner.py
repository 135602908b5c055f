"""Owns the model, the KV pools and the attention backend; runs one batch: forward, logits, sampling, logprobs."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..attention.base import ForwardBatch, ModelAttention
from ..attention.select import make_attention_backend
from ..cache import huge_pages
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from ..config import EngineArgs
from ..distributed.followers import Followers, NoFollowers
from ..distributed.parallel_state import TensorParallel
from ..distributed.spawn import Spawned, spawn_followers
from ..model.layers import attention_shape
from ..model.weights.checkpoint import load_config
from ..model.weights.loader import available_memory_bytes, resolve_dtype
from ..multimodal.embedder import image_embedder
from ..sampling.logprobs import TopEntries, token_logprobs, top_logprobs
from ..sampling.sampler import SamplingRow, sample
from .batch import ReqSlice, ScheduleBatch
from .compiled_decode import CompiledDecode
from .compiled_setup import DecodeTarget, adopted, compiled_decode, wants_graphs
from .cuda_graph_runner import CudaGraphRunner, capture_decode_graphs
from .decode_runner import DecodeRunner, EagerRunner, claimant, prepare_first
from .graph_builder import BackgroundGraphs
from .rank_control import model_tensors
from .serving_model import load_serving_model

logger = logging.getLogger("furcate.model_runner")

# mem_fraction_static's defaults: on CPU the share of free RAM for the KV cache; on a GPU the share of its memory
# for weights and KV cache (SGLang's meaning there; the rest is for activations and CUDA graphs).
CPU_MEM_FRACTION = 0.2
GPU_MEM_FRACTION = 0.85


@dataclass
class SamplingInputs:
    """What sampling a batch needs from the scheduler, snapshotted after the previous batch's tokens landed."""

    rows: list[SamplingRow]  # one per sampling slice, in batch order
    bitmask: torch.Tensor | None = None  # grammar masks, one row per sampling slice
    constrained: list[int] = field(default_factory=list)  # which sampling rows the bitmask constrains


@dataclass
class StepResult:
    """Per slice index: the sampled token (for slices that sample) and the logprobs asked for."""

    next_ids: dict[int, int] = field(default_factory=dict)
    output_logprobs: dict[int, float] = field(default_factory=dict)
    output_top: dict[int, TopEntries] = field(default_factory=dict)
    input_logprobs: dict[int, list[float]] = field(default_factory=dict)
    input_top: dict[int, list[TopEntries]] = field(default_factory=dict)
    sampled: torch.Tensor | None = None  # the sampled ids on the device, in sampling-slice order

    def drop(self, index: int) -> None:
        """Forget slice `index`'s sampled token and its logprobs (the overlap loop found it stale)."""
        for per_slice in (self.next_ids, self.output_logprobs, self.output_top):
            per_slice.pop(index, None)


class ModelRunner:
    """rank: this process's tensor-parallel rank. Rank 0 (the scheduler's runner) drives the other ranks when
    args.tp_size > 1 (spawned: their processes, when already started) and has them run each of its forwards; a
    follower's runner only runs forwards."""

    def __init__(self, args: EngineArgs, model_path: str, rank: int = 0, spawned: Spawned | None = None) -> None:
        self.args, self.model_path = args, model_path
        self.config = load_config(model_path)
        self.dtype = resolve_dtype(args.dtype, self.config, args.device)
        self.tp = TensorParallel(rank, args.tp_size)
        self.context_length = args.context_length or self.config.max_position_embeddings
        self.max_total_tokens = args.max_total_tokens or self._tokens_from_memory(args, model_path)
        self.followers: Followers | NoFollowers = NoFollowers()
        if rank == 0 and self.tp.size > 1:
            # Told before this rank loads, so every rank loads its shard at once; they share this pool size.
            self.followers = Followers(dataclasses.replace(args, max_total_tokens=self.max_total_tokens), model_path,
                                       spawned or spawn_followers(self.tp.size - 1))
        try:
            self._load(args, model_path)
            self.followers.wait_ready()
        except BaseException:
            self.followers.close(kill=True)
            raise

    def _load(self, args: EngineArgs, model_path: str) -> None:
        self.model, self.quantized = load_serving_model(model_path, self.dtype, args.quantization,
                                                        self._wants_graphs(args), args.device, self.tp)
        huge_pages.collapse(model_tensors(self.model).values())
        attn = self.model.model.layers[0].self_attn  # this rank's KV heads
        self.req_pool = ReqToTokenPool(args.max_running_requests, self.context_length + 1)
        self.kv_pool = TokenToKVPool(
            self.max_total_tokens, len(self.model.model.layers), attn.num_kv_heads, attn.head_dim, self.dtype,
            args.device,
        )
        self.attn_backend = make_attention_backend(args.attention_backend, args.device,
                                                   model_attention(self.model, self.dtype))
        self.images = image_embedder(model_path, self.dtype, args.device, self.tp.size)
        # The followers are looked up at each batch: close() replaces them.
        self.eager = EagerRunner(self.model, self.attn_backend, lambda forward: self.followers.snapshot(forward))
        self.graphs = self._capture_graphs(args)
        self.background: BackgroundGraphs | None = None
        self.compiled = self._compiled_decode(args)
        self.runners = self._runner_order()
        self.vocab_size = self.config.vocab_size
        self.forward_seconds = 0.0
        self.forward_calls = 0
        self.device = args.device
        self.forward_stream = torch.cuda.Stream(args.device) if args.device.startswith("cuda") else None

    def _capture_graphs(self, args: EngineArgs) -> CudaGraphRunner | None:
        return capture_decode_graphs(args, self.model, self.attn_backend, self.tp.size, self.req_pool, self.kv_pool)

    def _wants_graphs(self, args: EngineArgs) -> bool:
        return wants_graphs(args, self.tp.size)

    def _compiled_decode(self, args: EngineArgs) -> CompiledDecode | None:
        """The compiled CPU decode step (compiled_setup.py); a background build to adopt later, where it started."""
        target = DecodeTarget(self.model, self.kv_pool, self.model_path, self.dtype, self.quantized.max_rows)
        compiled, self.background = compiled_decode(args, self.tp.size, target)
        return compiled

    def _runner_order(self) -> list[DecodeRunner]:
        """The runners in the order they are asked to take a batch (decode_runner.py): compiled decode first (its
        plan is chosen before a CUDA graph would pad the batch), then the CUDA graphs, then eager, which takes any.
        Never both of the first two: compiled decode runs on a CPU, CUDA graphs on a GPU. A new list each time:
        the forward thread may be reading the old one."""
        return [runner for runner in (self.compiled, self.graphs) if runner is not None] + [self.eager]

    @property
    def graph_calls(self) -> int:
        """Forwards that replayed a CUDA graph."""
        return 0 if self.graphs is None else self.graphs.calls

    def decode_graphs(self) -> str:
        """How decode runs: "compiled" (its graphs loaded), "building" (eager until the builder's graphs load), or
        "eager" (also once a build failed or was stopped)."""
        building = self.background is not None and self.background.pending()
        return "compiled" if self.compiled is not None else "building" if building else "eager"

    def adopt_background_graphs(self) -> None:
        """Decode through the graphs the background build delivered, from the next batch on."""
        if self.background is not None and self.background.graphs is not None:
            self.compiled = adopted(self.args, self.model, self.kv_pool, self.background.graphs)
            self.runners = self._runner_order()
            self.background = None
            logger.info("decode runs through its compiled graphs from now on")

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again: resumed weights and K/V buffers live at new addresses. The replay count
        carries over to the new graphs (captured again: the checks that passed at start pass again)."""
        if self.graphs is not None:
            replays = self.graphs.calls
            self.graphs = self._capture_graphs(self.args)
            self.graphs.calls = replays
            self.runners = self._runner_order()

    def _tokens_from_memory(self, args: EngineArgs, model_path: str) -> int:
        _, num_kv_heads, head_dim = attention_shape(self.config)
        if args.device.startswith("cuda"):
            # Each rank's own GPU: its share of the KV heads, in what its free memory holds once its weights load.
            per_token = TokenToKVPool.bytes_per_token(self.config.num_hidden_layers,
                                                      max(num_kv_heads // self.tp.size, 1), head_dim, self.dtype)
            budget = gpu_kv_budget(args, checkpoint_bytes(model_path, self.dtype) // self.tp.size)
        else:
            # Every KV head counts, also under tensor parallelism: the ranks' pools share this host's memory.
            per_token = TokenToKVPool.bytes_per_token(self.config.num_hidden_layers, num_kv_heads, head_dim,
                                                      self.dtype)
            budget = int(available_memory_bytes() * (args.mem_fraction_static or CPU_MEM_FRACTION))
        return max(budget // per_token, 256)

    def prepare(self, batch: ScheduleBatch) -> None:
        """Everything of a forward that reads scheduler state; runs on the scheduler thread."""
        self.adopt_background_graphs()
        batch.forward = prepare_first(self.runners, batch.forward)

    @contextlib.contextmanager
    def on_forward_stream(self) -> Iterator[None]:
        """Where a batch's kernels run. On a GPU, a stream of their own, after the copies of their inputs the
        scheduler thread queued on the default one; the scheduler's next copies then need not wait for this
        forward's kernels. Those inputs outlive the forward: the batch holds them until the scheduler folds it in,
        after sampling has waited for every kernel here (tolist), so their memory is not reused under this stream."""
        if self.forward_stream is None:
            yield
            return
        self.forward_stream.wait_stream(torch.cuda.default_stream(self.forward_stream.device))
        with torch.cuda.stream(self.forward_stream):
            yield

    def run_batch(self, batch: ScheduleBatch, sampling_inputs: Callable[[], SamplingInputs]) -> StepResult:
        """Forward, then sample once the scheduler gives the sampling inputs (grammar masks)."""
        return self.sample(batch, self.forward(batch), sampling_inputs())

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Logits of the rows the batch asks for."""
        started = time.perf_counter()
        forward = batch.forward
        rows = torch.tensor([i for r in batch.logit_ranges for i in r], dtype=torch.long, device=forward.device)
        self.followers.run_step(forward, rows)
        if forward.images:
            forward.image_embeds = self.images.embed(forward.images)
        logits = claimant(self.runners, forward).run(forward, rows)
        self.forward_seconds += time.perf_counter() - started
        self.forward_calls += 1
        return logits

    def run_forward(self, forward: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """The model over a laid-out batch, then the logits of `rows`; every tensor-parallel rank runs this."""
        return self.eager.run(forward, rows)

    def close(self) -> None:
        """Stop the follower ranks (nothing to do without tensor parallelism) and a background graph build."""
        self.followers.close()
        self.followers = NoFollowers()
        if self.background is not None:
            self.background.stop()
            self.background = None

    def sample(self, batch: ScheduleBatch, logits: torch.Tensor, inputs: SamplingInputs) -> StepResult:
        per_slice = logits.split([len(r) for r in batch.logit_ranges])
        result = StepResult()
        sampling = [b for b, piece in enumerate(batch.slices) if piece.samples]
        if sampling:
            next_logits = torch.stack([per_slice[b][-1] for b in sampling])
            next_ids = sample(next_logits, inputs.rows, inputs.bitmask, inputs.constrained)
            result.next_ids = dict(zip(sampling, next_ids.tolist()))
            result.sampled = next_ids
        for b, piece in enumerate(batch.slices):
            if piece.req.return_logprob and len(per_slice[b]):
                self._add_logprobs(result, b, piece, per_slice[b])
        return result

    @staticmethod
    def _add_logprobs(result: StepResult, b: int, piece: ReqSlice, slice_logits: torch.Tensor) -> None:
        req = piece.req
        logprobs = torch.log_softmax(slice_logits, dim=-1)
        if piece.samples:
            chosen = torch.tensor([result.next_ids[b]], device=logprobs.device)
            result.output_logprobs[b] = token_logprobs(logprobs[-1:], chosen)[0]
            result.output_top[b] = top_logprobs(logprobs[-1:], req.top_logprobs_num)[0]
        if piece.input_rows:
            prompt_rows = logprobs[: len(piece.input_rows)]
            # Row p predicts prompt token p + 1.
            targets = torch.tensor(req.prompt_ids[piece.input_rows.start + 1 : piece.input_rows.stop + 1],
                                   device=logprobs.device)
            result.input_logprobs[b] = token_logprobs(prompt_rows, targets)
            if req.top_logprobs_num > 0:
                result.input_top[b] = top_logprobs(prompt_rows, req.top_logprobs_num)


def model_attention(model, dtype: torch.dtype) -> ModelAttention:
    """This rank's attention shape, for backends that plan a batch before its layers run."""
    layers = [layer.self_attn for layer in model.model.layers]
    return ModelAttention(num_heads=layers[0].num_heads, head_dim=layers[0].head_dim, scaling=layers[0].scaling,
                          dtype=dtype, windows=frozenset(a.sliding_window for a in layers),
                          logit_cap=layers[0].logit_cap, num_kv_heads=layers[0].num_kv_heads)


def gpu_kv_budget(args: EngineArgs, weight_bytes: int) -> int:
    """Bytes of KV cache on the GPU: SGLang's mem_fraction_static is the share of the GPU's memory for weights
    and KV cache together; the rest stays free for activations, CUDA graphs and other processes' use."""
    fraction = args.mem_fraction_static or GPU_MEM_FRACTION
    free, total = torch.cuda.mem_get_info(torch.device(args.device))
    budget = free - weight_bytes - int(total * (1 - fraction))
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free, weights "
                         f"{weight_bytes / 2**30:.1f} GiB, mem_fraction_static={fraction} of "
                         f"{total / 2**30:.1f} GiB; raise mem_fraction_static or pass max_total_tokens")
    return budget


def checkpoint_bytes(model_path: str, dtype: torch.dtype) -> int:
    """The weights' size in `dtype`, from the safetensors headers (no tensor is read)."""
    elements = 0
    for file in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            elements += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    return elements * torch.finfo(dtype).bits // 8

