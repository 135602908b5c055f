"""KV transfer backends: move bytes from this process's KV buffers into a peer process's, by address.

Both are existing engines (never a home-made socket protocol): Mooncake's TransferEngine over TCP with a
peer-to-peer handshake (no metadata server), or NIXL over UCX. Each process registers its KV buffers once; a
transfer is a batch of (local address, remote address, length) writes to the peer named by its session id.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from .. import registry
from .registry import TRANSFER_BACKEND

INSTALL_HINT = ("install furcate's [disagg] extra (pip install 'furcate[disagg]'); Mooncake also needs the system "
                "packages libibverbs1 and libnl-route-3-200 (apt-get install libibverbs1 libnl-route-3-200)")


# Mooncake refuses a batch of a few thousand writes (2,000 passed, 4,000 failed with status -1 here).
MOONCAKE_MAX_BATCH = 1024


class TransferError(RuntimeError):
    """A KV transfer did not complete; the request it belonged to fails, nothing else does."""


class TransferAgent(Protocol):
    session_id: str  # how a peer names this process when it writes here

    def register(self, buffers: list[torch.Tensor]) -> None: ...

    def write(self, peer: str, sources: list[int], destinations: list[int], lengths: list[int]) -> None:
        """Copy lengths[i] bytes from local address sources[i] to the peer's destinations[i]; raises
        TransferError when any of it fails."""


class MooncakeAgent:
    def __init__(self, host: str) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its per-connection INFO lines would flood the server log
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise RuntimeError(f"the mooncake transfer backend is not usable ({error}); {INSTALL_HINT}") from None
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine could not start on {host}")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            if self.engine.register_memory(buffer.data_ptr(), buffer.numel() * buffer.element_size()) != 0:
                raise RuntimeError("Mooncake could not register a KV buffer")

    def write(self, peer: str, sources: list[int], destinations: list[int], lengths: list[int]) -> None:
        for start in range(0, len(lengths), MOONCAKE_MAX_BATCH):
            batch = slice(start, start + MOONCAKE_MAX_BATCH)
            status = self.engine.batch_transfer_sync_write(peer, sources[batch], destinations[batch], lengths[batch])
            if status != 0:
                raise TransferError(f"Mooncake's write to {peer} failed (status {status})")


def make_agent(backend: str, host: str) -> TransferAgent:
    """The agent registered under `backend` (disaggregation/registry.py), imported only when chosen."""
    return registry.resolve(TRANSFER_BACKEND, backend)(host)
