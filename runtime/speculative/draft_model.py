"""The STANDALONE drafter: a small draft model proposes each decoding request's next tokens greedily.

The draft model has a ModelRunner of its own, with its own KV pool and request table (never the target's, nor the
prefix cache). Each request it drafts for keeps a DraftSeq: the draft K/V of a prefix of the request's tokens.
One drafting step for a batch:
  sync       cut each seq back to where it still agrees with its request's tokens (the target rejected a draft),
  forward 0  one extend over every request's tokens its seq lacks, up to its newest (the prompt, jumped or
             grammar-forced tokens, the token after the last draft): logits for draft 0,
  forward j  one decode over every request's draft j - 1: logits for draft j,
so a batch pays one draft forward per draft position, not one per request. A draft is the argmax of the draft
model's logits processed as the target's row will be (logit bias, penalties, min_new_tokens): a point mass, which
speculative/verify.py accepts exactly for greedy and sampled requests alike.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..attention.base import ForwardBatch
from ..config import EngineArgs
from ..executor.batch import ScheduleBatch, to_device
from ..executor.model_runner import ModelRunner
from ..sampling.sampler import adjust_logits
from .draft_check import check_vocab
from .drafter import Drafter, DraftRequest

logger = logging.getLogger("furcate.scheduler")


@dataclass
class DraftSeq:
    """One request's draft K/V: its row in the draft request table and the tokens whose K/V it holds, in order."""

    req: DraftRequest
    slot: int
    tokens: list[int] = field(default_factory=list)
    synced: int = 0  # tokens[:synced] are the request's own (its tokens are only ever appended)
    last_used: int = 0  # the drafting step that last used it: idle seqs give way first when memory is short


@dataclass
class Drafting:
    """A seq drafting this step: its request's tokens then, how many drafts it makes, and those made so far."""

    seq: DraftSeq
    fill: list[int]
    limit: int
    drafts: list[int] = field(default_factory=list)


def draft_args(args: EngineArgs, target: ModelRunner) -> EngineArgs:
    """The draft runner's arguments: one process (it runs on the scheduler's rank), the target's dtype and context,
    eager forwards (its batches change shape every position), and no speculation of its own."""
    return dataclasses.replace(
        args, tp_size=1, quantization=args.draft_quantization, dtype=str(target.dtype).removeprefix("torch."),
        context_length=target.context_length, disable_cuda_graph=True, enable_torch_compile=False,
        max_total_tokens=args.speculative_draft_max_total_tokens or target.max_total_tokens,
        speculative_algorithm=None, speculative_draft_model_path=None, speculative_draft_model_quantization=None,
        speculative_draft_max_total_tokens=None)


class StandaloneDrafter(Drafter):
    """Drafts with a small model of the target's vocabulary (speculative_draft_model_path)."""

    def __init__(self, args: EngineArgs, target: ModelRunner) -> None:
        path = args.speculative_draft_model_path
        self.runner = ModelRunner(draft_args(args, target), path)
        check_vocab(target.vocab_size, self.runner.vocab_size, path)
        self.chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
        self.seqs: dict[str, DraftSeq] = {}
        self.steps = 0

    def stats(self) -> dict[str, Any]:
        return {"spec_draft_kv_available": self.runner.kv_pool.available_size(),
                "spec_draft_max_total_tokens": self.runner.max_total_tokens,
                "spec_draft_req_slots_available": self.runner.req_pool.available_size(),
                "spec_draft_forward_calls": self.runner.forward_calls,
                "spec_draft_forward_seconds": self.runner.forward_seconds}

    def close(self) -> None:
        self.runner.close()

    # -- request lifetimes ----------------------------------------------------------------------------------

    def release(self, req: DraftRequest) -> None:
        seq = self.seqs.get(req.rid)
        if seq is not None and seq.req is req:
            self.drop(seq)

    def release_rid(self, rid: str) -> None:
        if rid in self.seqs:
            self.drop(self.seqs[rid])

    def drop(self, seq: DraftSeq) -> None:
        self.trim(seq, 0)
        self.runner.req_pool.free(seq.slot)
        del self.seqs[seq.req.rid]

    def trim(self, seq: DraftSeq, keep: int) -> None:
        """Free the draft K/V of seq.tokens[keep:]."""
        if len(seq.tokens) > keep:
            self.runner.kv_pool.free(self.runner.req_pool.req_to_token[seq.slot, keep : len(seq.tokens)].clone())
            del seq.tokens[keep:]
        seq.synced = min(seq.synced, keep)

    # -- drafting -------------------------------------------------------------------------------------------

    def propose(self, reqs: list[DraftRequest], limits: list[int]) -> list[list[int]]:
        self.steps += 1
        batch = [req for req, limit in zip(reqs, limits) if limit > 0]
        drafting, reserved = [], 0
        for req, limit in zip(reqs, limits):
            fill = req.fill_ids if limit > 0 else []
            if fill and (seq := self.admit(req, fill, batch)) is not None:
                # What this step writes for it: the tokens its seq lacks, and every draft but the last.
                needed = len(fill) - len(seq.tokens) + limit - 1
                if self.make_room(reserved + needed, 0, batch):
                    reserved += needed
                    drafting.append(Drafting(seq, fill, limit))
        if drafting and not self.run_safely(drafting):
            drafting = []
        drafts = {id(d.seq.req): d.drafts for d in drafting}
        return [drafts.get(id(req), []) for req in reqs]

    def admit(self, req: DraftRequest, fill: list[int], batch: list[DraftRequest]) -> DraftSeq | None:
        """The request's seq, synced to its tokens (fill); a new one when a request row is free (or can be freed by
        dropping a seq of a request outside the batch, retracted or not drafting now), else None."""
        seq = self.seqs.get(req.rid)
        if seq is not None and seq.req is not req:  # a finished request's rid, reused
            self.drop(seq)
            seq = None
        if seq is None:
            if not self.make_room(0, 1, batch):
                return None
            seq = self.seqs[req.rid] = DraftSeq(req, self.runner.req_pool.alloc())
        self.sync(seq, fill)
        seq.last_used = self.steps
        return seq

    def make_room(self, tokens: int, rows: int, batch: list[DraftRequest]) -> bool:
        """At least `tokens` free draft KV slots and `rows` free request rows, dropping the longest-idle seqs of
        requests outside `batch` as needed; none is dropped when even dropping them all would not do."""
        kv, table = self.runner.kv_pool, self.runner.req_pool
        in_batch = {id(req) for req in batch}
        idle = sorted((s for s in self.seqs.values() if id(s.req) not in in_batch), key=lambda s: s.last_used)
        if (kv.available_size() + sum(len(s.tokens) for s in idle) < tokens
                or table.available_size() + len(idle) < rows):
            return False
        while kv.available_size() < tokens or table.available_size() < rows:
            self.drop(idle.pop(0))
        return True

    @staticmethod
    def sync_point(seq: DraftSeq, fill: list[int]) -> int:
        """How much of seq.tokens is still the request's: its synced part, then drafts the target accepted. At
        least the newest token is left to feed, its logits give draft 0."""
        common = seq.synced
        while common < min(len(seq.tokens), len(fill)) and seq.tokens[common] == fill[common]:
            common += 1
        return min(common, len(fill) - 1)

    def sync(self, seq: DraftSeq, fill: list[int]) -> None:
        keep = self.sync_point(seq, fill)
        self.trim(seq, keep)
        seq.synced = keep

    def run_safely(self, drafting: list[Drafting]) -> bool:
        """run(), or on a failure of the draft model, no drafts this step: they only save time, and the draft K/V
        of the seqs involved is dropped (it may not have been written)."""
        try:
            self.run(drafting)
        except Exception as error:  # noqa: BLE001 - the target decodes on without drafts
            logger.warning("the draft model failed, drafting nothing this step: %s: %s", type(error).__name__, error)
            for d in drafting:
                self.drop(d.seq)
            return False
        return True

    def run(self, drafting: list[Drafting]) -> None:
        """Catch up (in chunks of chunked_prefill_size), then one forward per draft position."""
        while self.chunk and (behind := [d for d in drafting if len(d.fill) - len(d.seq.tokens) > self.chunk]):
            self.forward([d.seq for d in behind], [d.fill[len(d.seq.tokens) :][: self.chunk] for d in behind],
                         logits=False)
        logits = self.forward([d.seq for d in drafting], [d.fill[len(d.seq.tokens) :] for d in drafting])
        for d in drafting:
            d.seq.synced = len(d.fill)
        self.pick(drafting, logits)
        for position in range(1, max(d.limit for d in drafting)):
            active = [d for d in drafting if d.limit > position]
            self.pick(active, self.forward([d.seq for d in active], [[d.drafts[-1]] for d in active]))

    @staticmethod
    def pick(drafting: list[Drafting], logits: torch.Tensor) -> None:
        """Each row's draft: the argmax of its logits processed as the target will process its verify row."""
        rows = [dataclasses.replace(d.seq.req.sampling_row(), output_ids=d.seq.req.output_ids + d.drafts)
                for d in drafting]
        for d, token in zip(drafting, adjust_logits(logits, rows).argmax(dim=-1).tolist()):
            d.drafts.append(token)

    def forward(self, seqs: list[DraftSeq], feeds: list[list[int]], logits: bool = True) -> torch.Tensor:
        """Write each seq's next tokens into the draft pool (admit reserved the room) and run them; the logits
        of each seq's last token (none when `logits` is False)."""
        batch = self.layout(seqs, feeds, logits)
        self.runner.prepare(batch)
        with self.runner.on_forward_stream():
            return self.runner.forward(batch)

    def layout(self, seqs: list[DraftSeq], feeds: list[list[int]], logits: bool) -> ScheduleBatch:
        """A forward batch as batch.py lays out the target's: each seq's tokens at its next positions."""
        kv, table = self.runner.kv_pool, self.runner.req_pool.req_to_token
        lengths = [len(feed) for feed in feeds]
        slots = kv.alloc(sum(lengths))
        starts, offset, ranges = [], 0, []
        for seq, feed in zip(seqs, feeds):
            start = len(seq.tokens)
            table[seq.slot, start : start + len(feed)] = slots[offset : offset + len(feed)]
            seq.tokens.extend(feed)
            starts.append(start)
            offset += len(feed)
            ranges.append(range(offset - 1, offset) if logits else range(0))
        host = dict(dtype=torch.long, device="cpu")
        prefix, extend = torch.tensor(starts, **host), torch.tensor(lengths, **host)
        positions = torch.cat([torch.arange(s, s + n, **host) for s, n in zip(starts, lengths)])
        forward = ForwardBatch(
            input_ids=to_device(torch.tensor([t for feed in feeds for t in feed], **host), kv.device),
            positions=to_device(positions, kv.device), out_cache_loc=to_device(slots, kv.device),
            req_pool_indices=torch.tensor([seq.slot for seq in seqs], **host), prefix_lens=prefix,
            extend_lens=extend, seq_lens=prefix + extend, req_to_token_pool=self.runner.req_pool,
            token_to_kv_pool=kv)
        return ScheduleBatch([], forward, ranges)
