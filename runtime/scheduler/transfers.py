"""Prefill/decode disaggregation inside the scheduler loop: settle KV transfers and start new ones."""

from __future__ import annotations

from typing import Any

from .req import Req, bad_request


class TransferSteps:
    """Mixed into Scheduler; prefill_sender / decode_receiver are set on the side this server plays."""

    @property
    def transfers_pending(self) -> bool:
        """Disaggregated serving: requests whose K/V are on their way out or in."""
        side = self.prefill_sender or self.decode_receiver
        return side is not None and side.pending

    def advance_transfers(self) -> None:
        """Disaggregated serving: settle finished KV transfers, start new ones."""
        if self.prefill_sender is not None:
            for req, problem in self.prefill_sender.poll():
                self.memory.release(req)  # the prompt's K/V are intact either way: cache them
                if problem is not None:
                    self.finish(req, bad_request(problem, 502))
                elif req.pending is not None:  # else it was aborted meanwhile and has been answered
                    self.finish(req, req.finish_reason)
        if self.decode_receiver is not None:
            for req, outcome in self.decode_receiver.poll():
                self.land(req, outcome)
            self.decode_receiver.start_queued(self.running, self.memory.new_token_ratio)

    def land(self, req: Req, outcome: dict[str, Any]) -> None:
        """Decode side: the prompt's K/V arrived with the first token (or the transfer failed)."""
        token = outcome.get("first_token")
        valid = (isinstance(token, int) and not isinstance(token, bool) and 0 <= token < self.runner.vocab_size
                 and isinstance(outcome.get("logprob"), (int, float, type(None)))
                 and isinstance(outcome.get("top"), (list, type(None))))
        if "error" in outcome or not valid:
            self.decode_receiver.discard(req)  # what those slots hold is not this prompt's K/V
            if not req.finished:
                self.finish(req, bad_request(f"prefill/decode KV transfer failed: {outcome.get('error', outcome)}",
                                             502))
            return
        if req.finished:  # aborted while its K/V were on the way; they are good, so cache them
            self.memory.release(req)
            return
        self.cache.cache_unfinished_req(req)
        self.finish_prefill(req)
        self.take_token(req, token, outcome.get("logprob"), outcome.get("top"))
        if req.finished:
            self.memory.release(req)
            self.finish(req, req.finish_reason)
            return
        self.running.append(req)
        if (out := req.output_due()) is not None:  # the first token goes out now, not with the next step's
            self.outputs.append(out)
