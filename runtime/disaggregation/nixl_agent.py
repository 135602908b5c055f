"""NIXL (UCX) as the KV transfer backend: the peer's agent metadata is its session id, so a writer needs no
side channel; it adds each peer once and keeps it."""

from __future__ import annotations

import base64
import os
import time
import uuid

import torch

from .transfer import INSTALL_HINT, TransferError

# A write that has not completed in this long fails its request instead of holding the prefill side's slots.
WRITE_TIMEOUT_S = 60.0


class NixlAgent:
    def __init__(self, host: str) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # it logs every agent and backend at INFO
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError:
            try:
                from nixl._api import nixl_agent, nixl_agent_config
            except ImportError as error:
                raise RuntimeError(f"the nixl transfer backend is not usable ({error}); pip install nixl-cu12 "
                                   f"(it runs without a GPU), or use the mooncake backend: {INSTALL_HINT}") from None
        self.agent = nixl_agent(f"furcate-{host}-{uuid.uuid4().hex[:12]}", nixl_agent_config(backends=["UCX"]))
        self.session_id = ""  # set once buffers are registered: the metadata lists them
        self.peers: dict[str, str] = {}  # session id -> the agent name NIXL gave it

    def register(self, buffers: list[torch.Tensor]) -> None:
        self.agent.register_memory([(b.data_ptr(), b.numel() * b.element_size(), 0, "") for b in buffers], "DRAM")
        self.session_id = base64.b64encode(self.agent.get_agent_metadata()).decode()

    def write(self, peer: str, sources: list[int], destinations: list[int], lengths: list[int]) -> None:
        if not lengths:
            return
        if peer not in self.peers:
            self.peers[peer] = self.agent.add_remote_agent(base64.b64decode(peer))
        local = self.agent.get_xfer_descs([(s, n, 0) for s, n in zip(sources, lengths)], "DRAM")
        remote = self.agent.get_xfer_descs([(d, n, 0) for d, n in zip(destinations, lengths)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.peers[peer])
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + WRITE_TIMEOUT_S
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL's write ended in state {state}")
        finally:
            self.agent.release_xfer_handle(handle)
