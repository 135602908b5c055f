"""The scheduler's seam to speculative decoding (runtime/speculative/): drafts for a decode batch, the verify
forward that checks them, and giving back the KV of rejected drafts once the step's tokens are folded in.

Drafts ride in the decode batch as extra tokens of their request's slice (ReqSlice.draft), so the forward is an
extend over the cached prefix with logits at every drafted position. Only pure decode batches draft (a batch
with prefill chunks runs as before), and only on the plain loop: the overlap loop's token table carries one token
in flight per request, a verify step several (config.py refuses the combination).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ....grammars.base import allocate_bitmask
from ... import registry
from ...config import EngineArgs
from ...executor.batch import ReqSlice, ScheduleBatch
from ...executor.model_runner import ModelRunner, StepResult
from ...sampling.logprobs import TopEntries, token_logprobs, top_logprobs
from ...speculative.drafter import Drafter
from ...speculative.verify import Proposal, verify
from ...wire.messages import SpecCounts
from ..req import Req
from .base import SchedulerPlugin

logger = logging.getLogger("furcate.scheduler")

Token = tuple[int, float | None, TopEntries | None]  # a token with its logprob and top logprobs (when asked for)


@dataclass
class VerifyResult(StepResult):
    """A verify step's result: next_ids holds each slice's first token (as any step's), tokens all of them."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    tops: dict[int, list[TopEntries]] = field(default_factory=dict)


def step_tokens(result: StepResult, b: int) -> list[Token]:
    """The tokens slice b emitted this step, in order: one, or after a verify its accepted drafts and one more."""
    if isinstance(result, VerifyResult):
        tokens = result.tokens[b]
        logprobs, tops = result.logprobs.get(b), result.tops.get(b)
        return [(t, logprobs[i] if logprobs else None, tops[i] if tops else None) for i, t in enumerate(tokens)]
    return [(result.next_ids[b], result.output_logprobs.get(b), result.output_top.get(b))]


class Speculator(SchedulerPlugin):
    """Drafts for decode slices within the KV room left, verifies them, and trims what was rejected. A plug-in for
    its stats() and to tell the drafter when a request ends (finished or aborted): it holds no requests."""

    def __init__(self, args: EngineArgs, runner: ModelRunner) -> None:
        self.drafter: Drafter = registry.resolve("speculative_algorithm", args.speculative_algorithm)(args, runner)
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.jump_forward = not args.disable_jump_forward
        self.runner = runner
        self.totals = SpecCounts()

    def stats(self) -> dict[str, Any]:
        return {"spec_verify_steps": self.totals.verify_ct, "spec_draft_tokens": self.totals.draft_tokens,
                "spec_accepted_tokens": self.totals.accepted_tokens, **self.drafter.stats()}

    def take_finished(self, req: Req) -> bool:
        self.drafter.release(req)
        return False

    def remove(self, rid: str) -> list[Req]:
        self.drafter.release_rid(rid)
        return []

    def close(self) -> None:
        self.drafter.close()

    # -- drafting -------------------------------------------------------------------------------------------

    def shape_decode(self, slices: list[ReqSlice], room: int) -> None:
        """Give decode slices drafts, taking only the KV room `room` the scheduler leaves them: drafts never make it
        retract a request. The room is shared out in batch order, then the drafter proposes for all at once."""
        limits = []
        for piece in slices:
            readable = self.drafter.reads_images or not piece.req.images
            limits.append(max(min(room, self.draft_limit(piece)), 0) if readable else 0)
            room -= limits[-1]
        if not any(limits):
            return
        proposed = self.drafter.propose([piece.req for piece in slices], limits)
        for piece, tokens in zip(slices, proposed):
            tokens = in_vocabulary(tokens, self.runner.vocab_size)
            piece.draft = (self.grammar_prefix(piece.req, tokens) if tokens and piece.req.matcher is not None
                           else tokens)
            piece.length += len(piece.draft)

    def draft_limit(self, piece: ReqSlice) -> int:
        """Drafts worth verifying: a step emits at most drafts + 1 tokens, never past max_new_tokens or the
        context (so no KV position passes the request table's row)."""
        req = piece.req
        if piece.length != 1:  # tokens a grammar forced, still without KV: the slice is an extend already
            return 0
        left = min(req.remaining_output, self.runner.context_length - len(req.input_ids) - len(req.output_ids))
        return min(self.num_draft_tokens, left - 1)

    def grammar_prefix(self, req: Req, tokens: list[int]) -> list[int]:
        """The drafts the grammar allows in a row. Drafting stops before a token after which the grammar forces a
        continuation: plain decoding would jump forward there instead of sampling, so no token may follow it in
        this step (the scheduler jumps forward after the step's last token, as after any step)."""
        matcher, accepted, kept = req.matcher, 0, 0
        jumps = self.jump_forward and not req.return_logprob  # the scheduler's own condition for jumping
        for token in tokens:
            if not matcher.accept(token):
                break
            accepted += 1
            if matcher.is_terminated():  # the request stops at this token: nothing after it is worth drafting
                kept = accepted
                break
            if jumps and forces_continuation(matcher):
                break
            kept = accepted
        matcher.rollback(accepted)
        return tokens[:kept]

    # -- verifying ------------------------------------------------------------------------------------------

    def run(self, batch: ScheduleBatch) -> VerifyResult:
        """The verify forward of a decode batch where some slices carry drafts (slices without any sample their
        one token exactly as a plain step)."""
        logits = self.runner.forward(batch)
        proposals = [Proposal.of(piece.req.sampling_row(), piece.draft) for piece in batch.slices]
        bitmask, constrained = self.masks(batch)
        emitted = verify(logits, proposals, bitmask, constrained)
        result = VerifyResult()
        per_slice = logits.split([len(r) for r in batch.logit_ranges])
        for b, (piece, tokens) in enumerate(zip(batch.slices, emitted)):
            result.next_ids[b], result.tokens[b] = tokens[0], tokens
            if piece.req.return_logprob:
                self.add_logprobs(result, b, piece.req, per_slice[b][: len(tokens)], tokens)
        return result

    def masks(self, batch: ScheduleBatch) -> tuple[torch.Tensor | None, list[int]]:
        """Grammar masks for every verify row: row j of a slice is its matcher's state after its drafts 0..j-1
        (advanced here and rolled back; the scheduler accepts the emitted tokens when it folds the step in)."""
        if not any(piece.req.matcher is not None for piece in batch.slices):
            return None, []
        bitmask = allocate_bitmask(sum(1 + len(piece.draft) for piece in batch.slices), self.runner.vocab_size)
        constrained, offset = [], 0
        for piece in batch.slices:
            if piece.req.matcher is not None:
                constrained += fill_rows(piece.req.matcher, piece.draft, bitmask, offset)
            offset += 1 + len(piece.draft)
        return bitmask, constrained

    @staticmethod
    def add_logprobs(result: VerifyResult, b: int, req: Req, rows: torch.Tensor, tokens: list[int]) -> None:
        """From the raw logits of the rows that predicted each emitted token, as a plain step reports them."""
        logprobs = torch.log_softmax(rows, dim=-1)
        result.logprobs[b] = token_logprobs(logprobs, torch.tensor(tokens, device=logprobs.device))
        result.tops[b] = top_logprobs(logprobs, req.top_logprobs_num)

    # -- folding in -----------------------------------------------------------------------------------------

    def tokens_taken(self, req: Req, piece: ReqSlice, emitted: int, taken: int) -> None:
        """After the scheduler took `taken` of the `emitted` tokens (a stop cuts the rest): free the KV of every
        draft that did not become the request's token, so neither its table nor the prefix cache holds it."""
        counts = req.spec_counts = req.spec_counts or SpecCounts()
        if piece.draft:
            accepted = min(emitted - 1, taken)
            self.free_from(req, piece.start + 1 + accepted)
            for total in (counts, self.totals):
                total.verify_ct += 1
                total.draft_tokens += len(piece.draft)
                total.accepted_tokens += accepted
        req.output().spec = counts

    def free_from(self, req: Req, keep: int) -> None:
        if req.req_pool_idx is not None and req.kv_len > keep:
            table = self.runner.req_pool.req_to_token
            self.runner.kv_pool.free(table[req.req_pool_idx, keep : req.kv_len].clone())
            req.kv_len = keep


def in_vocabulary(tokens: list[int], vocab_size: int) -> list[int]:
    """The drafts before the first image pad (an id past the vocabulary, copied from a prompt that shows an
    image): a pad has no embedding of its own outside its image's rows."""
    for i, token in enumerate(tokens):
        if token >= vocab_size:
            return tokens[:i]
    return tokens


def fill_rows(matcher: Any, draft: list[int], bitmask: torch.Tensor, offset: int) -> list[int]:
    """Fill bitmask rows offset .. offset + len(draft) from the matcher's state before each draft; a state past
    the grammar's end keeps its row open (the request stops at the token that ended it, the row goes unused)."""
    rows = []
    for j in range(len(draft) + 1):
        if not matcher.is_terminated():
            matcher.fill_bitmask(bitmask, offset + j)
            rows.append(offset + j)
        if j < len(draft):
            matcher.accept(draft[j])
    matcher.rollback(len(draft))
    return rows


def forces_continuation(matcher: Any) -> bool:
    try:
        return bool(matcher.jump_forward())
    except Exception as error:  # noqa: BLE001 - only ends the drafts here; the scheduler's own jump reports it
        logger.debug("jump-forward check failed while drafting: %s: %s", type(error).__name__, error)
        return True
