"""FinishReason: each constructor's SGLang dict shape, the predicates readers use, and pickling across processes."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from furcate.runtime.engine.detokenizer import trim_stop
from furcate.runtime.wire.finish_reason import FinishReason
from furcate.runtime.wire.messages import ReqOutput

SHAPES = [
    (FinishReason.stop_token(2), {"type": "stop", "matched": 2}),
    (FinishReason.stop_string("\n\n"), {"type": "stop", "matched": "\n\n"}),
    (FinishReason.length(16), {"type": "length", "length": 16}),
    (FinishReason.length(0), {"type": "length", "length": 0}),
    (FinishReason.abort("aborted by request"), {"type": "abort", "message": "aborted by request"}),
    (FinishReason.abort("odd", status=418), {"type": "abort", "message": "odd", "status_code": 418}),
    (FinishReason.bad_request("bad grammar"), {"type": "abort", "message": "bad grammar", "status_code": 400}),
    (FinishReason.internal_error("crashed"), {"type": "abort", "message": "crashed", "status_code": 500}),
    (FinishReason.peer_failure("transfer failed"),
     {"type": "abort", "message": "transfer failed", "status_code": 502}),
]


@pytest.mark.parametrize(("reason", "shape"), SHAPES)
def test_to_dict_is_sglangs_shape(reason: FinishReason, shape: dict) -> None:
    assert reason.to_dict() == shape
    # Byte for byte as the native server serializes it: same keys, same order, plain ints.
    assert json.dumps(reason.to_dict()) == json.dumps(shape)


@pytest.mark.parametrize(("reason", "shape"), SHAPES)
def test_pickles_inside_a_req_output(reason: FinishReason, shape: dict) -> None:
    out = pickle.loads(pickle.dumps(ReqOutput(rid="r", new_token_ids=[5], finish_reason=reason)))
    assert out.finish_reason == reason and out.finish_reason.to_dict() == shape


def test_is_frozen() -> None:
    reason = FinishReason.stop_token(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        reason.matched = 3  # type: ignore[misc]


def test_errors_are_aborts_with_a_status() -> None:
    assert FinishReason.bad_request("x").is_error and FinishReason.bad_request("x").status == 400
    assert FinishReason.internal_error("x").status == 500 and FinishReason.peer_failure("x").status == 502
    by_caller = FinishReason.abort("aborted by request")
    assert by_caller.is_abort and not by_caller.is_error and by_caller.status is None
    for finished in (FinishReason.stop_token(2), FinishReason.stop_string("x"), FinishReason.length(3)):
        assert not finished.is_abort and not finished.is_error


def test_stop_text_and_token_tell_the_two_stops_apart() -> None:
    by_token, by_string = FinishReason.stop_token(7), FinishReason.stop_string("END")
    assert (by_token.stop_token_id, by_token.stop_text) == (7, None)
    assert (by_string.stop_token_id, by_string.stop_text) == (None, "END")
    assert FinishReason.length(3).stop_token_id is None and FinishReason.length(3).stop_text is None


def test_trim_stop_cuts_only_at_a_stop_string() -> None:
    assert trim_stop("abc END tail", FinishReason.stop_string("END"), no_stop_trim=False) == "abc "
    assert trim_stop("abc END tail", FinishReason.stop_string("END"), no_stop_trim=True) == "abc END tail"
    assert trim_stop("abc END tail", FinishReason.stop_token(7), no_stop_trim=False) == "abc END tail"
    assert trim_stop("abc END tail", None, no_stop_trim=False) == "abc END tail"
