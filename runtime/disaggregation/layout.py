"""Where a KV pool's bytes live, and the write list that copies one request's K/V between two pools."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..cache.memory_pool import TokenToKVPool


@dataclass(frozen=True)
class KVLayout:
    """Per layer, the address of slot 0 of the K and V buffers; a slot's bytes follow at slot * slot_bytes."""

    dtype: str
    slot_bytes: int
    num_slots: int  # slots per layer buffer, slot 0 included: writes must land inside the registered buffers
    k_addrs: list[int]
    v_addrs: list[int]

    @classmethod
    def of(cls, pool: TokenToKVPool) -> KVLayout:
        first = pool.k_buffer[0]
        return cls(str(first.dtype).removeprefix("torch."), first[0].numel() * first.element_size(), first.shape[0],
                   [b.data_ptr() for b in pool.k_buffer], [b.data_ptr() for b in pool.v_buffer])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVLayout:
        return cls(str(data["dtype"]), int(data["slot_bytes"]), int(data["num_slots"]),
                   [int(a) for a in data["k_addrs"]], [int(a) for a in data["v_addrs"]])

    def mismatch(self, peer: KVLayout) -> str | None:
        """Why K/V cannot be copied slot for slot into the peer's pool (different model or dtype), or None."""
        mine = (len(self.k_addrs), self.slot_bytes, self.dtype)
        theirs = (len(peer.k_addrs), peer.slot_bytes, peer.dtype)
        if mine != theirs:
            return (f"the prefill and decode servers hold different KV layouts (layers, bytes per token, dtype): "
                    f"{mine} vs {theirs}; run both with the same model and dtype")
        return None


def runs(sources: list[int], destinations: list[int]) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, count) for each stretch where both sides' slots are
    consecutive, so a request whose slots are mostly contiguous moves in a few large writes rather than one per
    token. A stretch may also run downwards on both sides at once (the pool hands out fresh slots in falling
    order): the blocks then still match slot for slot, from their lowest slots up."""
    out: list[tuple[int, int, int, int]] = []  # (start source, start destination, count, step +1 or -1)
    for src, dst in zip(sources, destinations):
        if out:
            first_src, first_dst, count, step = out[-1]
            last_src, last_dst = first_src + step * (count - 1), first_dst + step * (count - 1)
            for direction in ((step,) if count > 1 else (1, -1)):
                if src == last_src + direction and dst == last_dst + direction:
                    out[-1] = (first_src, first_dst, count + 1, direction)
                    break
            else:
                out.append((src, dst, 1, 1))
        else:
            out.append((src, dst, 1, 1))
    return [(s, d, n) if step == 1 else (s - n + 1, d - n + 1, n) for s, d, n, step in out]


def write_list(local: KVLayout, peer: KVLayout, sources: list[int], destinations: list[int]
               ) -> tuple[list[int], list[int], list[int]]:
    """Addresses and lengths copying K and V of every layer from the local slots to the peer's."""
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    stretches = runs(sources, destinations)
    size = local.slot_bytes
    for local_bases, peer_bases in ((local.k_addrs, peer.k_addrs), (local.v_addrs, peer.v_addrs)):
        for local_base, peer_base in zip(local_bases, peer_bases):
            for src, dst, count in stretches:
                src_addrs.append(local_base + src * size)
                dst_addrs.append(peer_base + dst * size)
                lengths.append(count * size)
    return src_addrs, dst_addrs, lengths


def kv_buffers(pool: TokenToKVPool) -> list[torch.Tensor]:
    return [*pool.k_buffer, *pool.v_buffer]
