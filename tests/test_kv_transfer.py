"""The parts of prefill/decode disaggregation that need no second process: the write list that copies K/V
between two pools, the room registry's pairing and its write-or-withdraw guarantee, and request validation."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from furcate.runtime.cache.memory_pool import TokenToKVPool
from furcate.runtime.disaggregation.bootstrap import RoomRegistry
from furcate.runtime.disaggregation.layout import KVLayout, runs, write_list
from furcate.runtime.engine.generate_request import BootstrapFields, GenerateRequest
from furcate.runtime.engine.request_builder import RequestBuilder
from furcate.runtime.wire.messages import SchedulerReady


def test_runs_merge_stretches_consecutive_on_both_sides():
    assert runs([5, 6, 7, 9, 10], [20, 21, 30, 31, 32]) == [(5, 20, 2), (7, 30, 1), (9, 31, 2)]
    assert runs([], []) == []
    # Falling on both sides: one block, from the lowest slots up. Mixed directions never merge.
    assert runs([9, 8, 7, 3], [40, 39, 38, 37]) == [(7, 38, 3), (3, 37, 1)]
    assert runs([9, 8, 7], [1, 2, 3]) == [(9, 1, 1), (8, 2, 1), (7, 3, 1)]
    assert runs([4, 5, 4, 3], [10, 11, 10, 9]) == [(4, 10, 2), (3, 9, 2)]


def test_the_write_list_copies_every_layer_into_the_peer_slots():
    """Apply the write list with plain memory copies between two real pools: the peer's slots then hold exactly
    the local slots' K and V, in every layer, and no other peer slot changes."""
    local = TokenToKVPool(40, 3, 2, 4, torch.float32)
    peer = TokenToKVPool(40, 3, 2, 4, torch.float32)
    for buffer in local.k_buffer + local.v_buffer:
        buffer.copy_(torch.randn_like(buffer))
    before = [b.clone() for b in peer.k_buffer + peer.v_buffer]
    sources, destinations = [3, 4, 5, 11, 12, 30, 29, 28], [7, 8, 20, 21, 22, 3, 2, 1]
    src, dst, lengths = write_list(KVLayout.of(local), KVLayout.of(peer), sources, destinations)
    assert len(lengths) == 2 * 3 * 4  # K and V, 3 layers, 4 stretches (the last one falling)
    for s, d, n in zip(src, dst, lengths):
        ctypes_copy(d, s, n)
    for layer in range(3):
        for kind in ("k_buffer", "v_buffer"):
            mine, theirs = getattr(local, kind)[layer], getattr(peer, kind)[layer]
            assert torch.equal(theirs[destinations], mine[sources])
            untouched = [i for i in range(41) if i not in destinations]
            index = (0 if kind == "k_buffer" else 3) + layer
            assert torch.equal(theirs[untouched], before[index][untouched])


def ctypes_copy(dst: int, src: int, length: int) -> None:
    import ctypes

    ctypes.memmove(dst, src, length)


def test_layouts_of_different_models_do_not_match():
    a = KVLayout.of(TokenToKVPool(8, 2, 2, 4, torch.float32))
    assert a.mismatch(KVLayout.from_json(a.to_json())) is None
    assert "different KV layouts" in a.mismatch(KVLayout.of(TokenToKVPool(8, 2, 2, 4, torch.bfloat16)))
    assert "different KV layouts" in a.mismatch(KVLayout.of(TokenToKVPool(8, 3, 2, 4, torch.float32)))


def test_registry_pairs_either_arrival_order():
    registry = RoomRegistry()
    seen = []
    registry.expect(1, seen.append)  # prefill first
    first = registry.claim(1, {"who": "decode"})
    second = registry.claim(2, {"who": "decode"})  # decode first
    registry.expect(2, seen.append)
    assert seen == [first, second]
    assert registry.claim(2, {}) is None  # a room is claimed once


def test_a_claim_is_either_withdrawn_or_written_never_both():
    registry = RoomRegistry()
    claim = registry.claim(3, {})
    assert registry.withdraw(3, claim)
    assert not registry.begin_write(claim)  # the decode side gave up first: nothing may be written
    claim = registry.claim(4, {})
    assert registry.begin_write(claim)
    assert not registry.withdraw(4, claim)  # writing began: the decode side must wait for the outcome
    registry.settle(4, claim, {"first_token": 5})
    assert claim.outcome.result(timeout=1) == {"first_token": 5}
    assert registry.forget(5) is False  # nothing expected
    registry.expect(6, lambda c: None)
    assert registry.forget(6) is True and registry.claim(6, {}) is not None


def test_concurrent_withdraw_and_write_agree():
    for room in range(200):
        registry = RoomRegistry()
        claim = registry.claim(room, {})
        results = {}
        withdraw = functools.partial(registry.withdraw, room, claim)
        write = functools.partial(registry.begin_write, claim)
        threads = [threading.Thread(target=lambda w=withdraw, r=results: r.__setitem__("w", w())),
                   threading.Thread(target=lambda b=write, r=results: r.__setitem__("b", b()))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results["w"] != results["b"]


@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
def test_bootstrap_fields_are_checked_per_mode(tokenizer, mode):
    info = SchedulerReady(max_total_tokens=1000, max_req_len=500, context_length=500, vocab_size=len(tokenizer),
                          disaggregation_mode=mode)
    builder = RequestBuilder(tokenizer, info)
    pairing = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12}

    def build(prompt="hi", params=None, **fields):
        return builder.build(GenerateRequest(prompt, params, bootstrap=BootstrapFields.from_keywords(fields)))

    if mode == "null":
        with pytest.raises(ValueError, match="serves requests whole"):
            build(**pairing)
        assert build()[0][0].bootstrap is None
        return
    reqs, _ = build(**pairing)
    assert (reqs[0].bootstrap.host, reqs[0].bootstrap.port, reqs[0].bootstrap.room) == ("127.0.0.1", 8998, 12)
    for host in ("prefill-0.cluster.local", "::1", "[fe80::1]"):
        assert build(**{**pairing, "bootstrap_host": host})[0][0].bootstrap.host == host
    with pytest.raises(ValueError, match="missing bootstrap_room"):
        build(bootstrap_host="127.0.0.1", bootstrap_port=8998)
    for bad in ({"bootstrap_port": 0}, {"bootstrap_port": "8998"}, {"bootstrap_room": -1}, {"bootstrap_room": 2**64},
                {"bootstrap_room": 1.5}, {"bootstrap_host": ""}, {"bootstrap_host": ["h"]}, {"bootstrap_room": True},
                {"bootstrap_host": "evil.example/x?"}, {"bootstrap_host": "user@host"}, {"bootstrap_host": "a b"},
                {"bootstrap_host": "h\ud800"}):
        with pytest.raises(ValueError, match="bootstrap_"):
            build(**{**pairing, **bad})
    with pytest.raises(ValueError, match="single prompt"):
        build(["a", "b"], **pairing)
    with pytest.raises(ValueError, match="single prompt"):
        build(params={"n": 2}, **pairing)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        build(params={"max_new_tokens": 0}, **pairing)


@pytest.mark.parametrize("fields, message", [
    ({"disaggregation_mode": "both"}, "disaggregation_mode"),
    ({"disaggregation_transfer_backend": "rdma"}, "disaggregation_transfer_backend"),
    ({"disaggregation_bootstrap_port": 0}, "disaggregation_bootstrap_port"),
    ({"disaggregation_timeout": float("nan")}, "disaggregation_timeout"),
    ({"disaggregation_timeout": 0}, "disaggregation_timeout"),
    ({"disaggregation_mode": "decode", "tp_size": 2}, "tp_size"),
])
def test_disaggregation_arguments_are_checked(fields, message):
    from furcate.runtime.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**fields)


def test_bootstrap_service_refuses_malformed_claims():
    """The real bootstrap service on loopback: bodies that are not claims get a 400 at once, nothing waits."""
    import requests

    from furcate.runtime.disaggregation.bootstrap import BootstrapServer
    from processes import free_port

    port = free_port()
    registry = RoomRegistry()
    BootstrapServer(registry, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/rooms/5"
    for body in ("[1, 2]", '"text"', "{}", '{"timeout": "soon"}', '{"timeout": NaN}', '{"timeout": -1}',
                 '{"timeout": 1e300}', "not json"):
        response = requests.post(url, data=body, headers={"content-type": "application/json"}, timeout=10)
        assert response.status_code == 400, (body, response.text)
    assert requests.post(f"http://127.0.0.1:{port}/rooms/x", json={"timeout": 1}, timeout=10).status_code == 400
    # A well-formed claim nobody serves times out with a 504 and leaves the room free again.
    response = requests.post(url, json={"timeout": 0.2}, timeout=10)
    assert response.status_code == 504 and registry.claim(5, {}) is not None
