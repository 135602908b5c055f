"""Fields sglang-router and SGLang's own clients add to request bodies that furcate has no use for.

The router fills in SGLang's full request schema (seen on /generate: background, log_metrics, model, no_logs,
return_bytes, return_entropy, return_hidden_states; on the chat route also continue_final_message,
separate_reasoning, stream_reasoning). Values that change nothing here are dropped; a request that turns on a
feature furcate does not have is refused, naming it, instead of silently getting less than it asked for.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError

# sglang-router --pd-disaggregation pairs a request's prefill and decode halves with these (the engine checks them).
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# Advisory: any value of the right type is fine (logging switches, the model name a one-model server ignores,
# reasoning parsing for a server that runs no reasoning parser).
ADVISORY = {"log_metrics": bool, "no_logs": bool, "model": str, "separate_reasoning": bool,
            "stream_reasoning": bool}
# Features: only off is accepted.
FEATURES = {
    "background": "background requests",
    "return_bytes": "token bytes in outputs",
    "return_entropy": "entropy outputs",
    "return_hidden_states": "hidden states outputs",
    "continue_final_message": "continuing the final assistant message",
}


def strip_router_fields(body: dict[str, Any], keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """body without the fields above (those in `keep` are left for the route's own parser)."""
    out = {}
    for key, value in body.items():
        if key in keep or (key not in ADVISORY and key not in FEATURES):
            out[key] = value
        elif key in ADVISORY:
            if value is not None and not isinstance(value, ADVISORY[key]):
                raise ApiError(400, f"{key} must be a {ADVISORY[key].__name__}, got {value!r}")
        elif value not in (None, False):
            raise ApiError(400, f"{key}={value!r} is not supported: furcate has no {FEATURES[key]}")
    return out
