"""Owns the model, the KV pools and the attention backend; runs one batch: forward, logits, sampling, logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..attention.torch_native import TorchNativeAttention
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from ..config import EngineArgs
from ..model.loader import load_config, load_model, resolve_dtype
from ..sampling.logprobs import TopEntries, token_logprobs, top_logprobs
from ..sampling.sampler import sample
from .batch import ScheduleBatch

ATTENTION_BACKENDS = {"torch_native": TorchNativeAttention}


@dataclass
class StepResult:
    next_ids: list[int]
    output_logprobs: dict[int, float] = field(default_factory=dict)  # batch index -> logprob
    output_top: dict[int, TopEntries] = field(default_factory=dict)
    input_logprobs: dict[int, list[float | None]] = field(default_factory=dict)
    input_top: dict[int, list[TopEntries | None]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, args: EngineArgs, model_path: str) -> None:
        self.config = load_config(model_path)
        self.dtype = resolve_dtype(args.dtype, self.config)
        self.model = load_model(model_path, self.dtype, args.device)
        self.context_length = args.context_length or self.config.max_position_embeddings
        attn = self.model.model.layers[0].self_attn
        self.max_total_tokens = args.max_total_tokens or self._tokens_from_memory(args, attn)
        self.req_pool = ReqToTokenPool(args.max_running_requests, self.context_length + 1, args.device)
        self.kv_pool = TokenToKVPool(
            self.max_total_tokens, len(self.model.model.layers), attn.num_kv_heads, attn.head_dim, self.dtype, args.device
        )
        self.attn_backend = ATTENTION_BACKENDS[args.attention_backend]()
        self.vocab_size = self.config.vocab_size
        self.forward_seconds = 0.0
        self.forward_calls = 0

    def _tokens_from_memory(self, args: EngineArgs, attn) -> int:
        per_token = TokenToKVPool.bytes_per_token(
            len(self.model.model.layers), attn.num_kv_heads, attn.head_dim, self.dtype
        )
        budget = int(available_memory_bytes() * args.mem_fraction_static)
        return max(budget // per_token, 256)

    def run(self, batch: ScheduleBatch) -> StepResult:
        started = time.perf_counter()
        hidden = self.model(batch.forward, self.attn_backend)
        rows = torch.tensor([i for r in batch.logit_ranges for i in r], dtype=torch.long)
        logits = self.model.compute_logits(hidden[rows])
        self.forward_seconds += time.perf_counter() - started
        self.forward_calls += 1
        ends = torch.tensor([len(r) for r in batch.logit_ranges]).cumsum(0)
        next_logits = logits[ends - 1]
        next_ids = sample(next_logits, [req.sampling_row() for req in batch.reqs])
        result = StepResult(next_ids=next_ids.tolist())
        for b, req in enumerate(batch.reqs):
            if req.return_logprob:
                self._add_logprobs(result, b, req, logits[int(ends[b]) - len(batch.logit_ranges[b]) : int(ends[b])],
                                   next_ids[b], batch.is_prefill)
        return result

    def _add_logprobs(self, result: StepResult, b: int, req, req_logits: torch.Tensor, next_id: torch.Tensor,
                      is_prefill: bool) -> None:
        logprobs = torch.log_softmax(req_logits, dim=-1)
        result.output_logprobs[b] = token_logprobs(logprobs[-1:], next_id.view(1))[0]
        result.output_top[b] = top_logprobs(logprobs[-1:], req.top_logprobs_num)[0]
        if not is_prefill:
            return
        start = req.input_logprob_start
        # Row j predicts prompt token j + 1; position 0 has no logprob.
        targets = torch.tensor(req.input_ids[max(start, 1) :], dtype=torch.long)
        prompt_rows = logprobs[:-1]
        head: list = [None] if start == 0 else []
        result.input_logprobs[b] = head + token_logprobs(prompt_rows, targets)
        if req.top_logprobs_num > 0:
            result.input_top[b] = head + top_logprobs(prompt_rows, req.top_logprobs_num)


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass max_total_tokens")
