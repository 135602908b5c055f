"""Why a request ended: one frozen value the scheduler, the engine and the server share.

Inside the runtime a request's end is a `FinishReason`; SGLang's dict shape (`{"type": "stop", "matched": ...}`,
`{"type": "length", "length": n}`, `{"type": "abort", "message": m}` plus `"status_code"` for a refused request)
exists only where results leave the runtime, through `to_dict`. It crosses the scheduler's process boundary
pickled inside ReqOutput, so it holds plain values only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# HTTP statuses an abort can carry; the engine raises for these, the server answers with them.
BAD_REQUEST = 400
INTERNAL_ERROR = 500
PEER_FAILURE = 502  # a server this request depended on (disaggregated serving's other half) failed it

FinishKind = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class FinishReason:
    """Build one with the constructors; the fields that do not belong to `kind` stay None."""

    kind: FinishKind
    matched: str | int | None = None  # stop: the stop string, or the token id, that ended the output
    output_length: int | None = None  # length: the output tokens the request ended with
    message: str | None = None  # abort: what happened
    status: int | None = None  # abort: the HTTP status of a refused request; None for one aborted by its caller

    @classmethod
    def stop_token(cls, token_id: int) -> FinishReason:
        return cls("stop", matched=token_id)

    @classmethod
    def stop_string(cls, text: str) -> FinishReason:
        """A stop string (or a stop regex's match) appeared in the output."""
        return cls("stop", matched=text)

    @classmethod
    def length(cls, output_tokens: int) -> FinishReason:
        """max_new_tokens or the context length was reached."""
        return cls("length", output_length=output_tokens)

    @classmethod
    def abort(cls, message: str, status: int | None = None) -> FinishReason:
        """Ended early: by its caller (no status), or refused by the runtime (with the status the caller sees)."""
        return cls("abort", message=message, status=status)

    @classmethod
    def bad_request(cls, message: str) -> FinishReason:
        return cls.abort(message, BAD_REQUEST)

    @classmethod
    def internal_error(cls, message: str) -> FinishReason:
        return cls.abort(message, INTERNAL_ERROR)

    @classmethod
    def peer_failure(cls, message: str) -> FinishReason:
        return cls.abort(message, PEER_FAILURE)

    @property
    def is_error(self) -> bool:
        """The runtime refused or failed this request: the engine raises instead of returning a result."""
        return self.status is not None

    @property
    def is_abort(self) -> bool:
        return self.kind == "abort"

    @property
    def stop_text(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self.matched if isinstance(self.matched, str) else None

    @property
    def stop_token_id(self) -> int | None:
        """The token id that ended the output, or None."""
        return self.matched if isinstance(self.matched, int) else None

    def to_dict(self) -> dict[str, Any]:
        """SGLang's shape, as the Engine's meta_info and the native /generate return it."""
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.output_length}
        shape: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status is not None:
            shape["status_code"] = self.status
        return shape
