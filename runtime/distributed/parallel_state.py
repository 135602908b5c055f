"""Which tensor-parallel rank this process is, and the torch.distributed group all ranks join.

The group is the default (world) group: world_size == tp_size, rank 0 is the scheduler process. Every collective
in the model uses it, so every rank must run the same forwards in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Collectives only run while every rank computes the same step (followers idle on a pipe, not in a collective),
# so this bounds how long one layer's reduce may wait for a slow rank, not how long a server may sit idle.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group; size 1 is the plain single-process runtime."""

    rank: int = 0
    size: int = 1

    def shard(self, count: int) -> int:
        """Rows, heads or columns of `count` that this rank holds (count divisible by size)."""
        return count // self.size

    def padded(self, count: int) -> int:
        """`count` rounded up to a multiple of size: the vocabulary every rank holds an equal share of."""
        return -(-count // self.size) * self.size


SINGLE = TensorParallel()


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """One GPU per rank: a bare "cuda" means cuda:<rank> (an explicit cuda:N is kept); CPU ranks share "cpu"."""
    return f"cuda:{rank}" if device == "cuda" else device


def create_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (port 0: the OS picks; no race with other servers)."""
    return dist.TCPStore(LOOPBACK, 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)


def join_group(tp: TensorParallel, device: str, store: dist.TCPStore | None = None, port: int = 0) -> None:
    """Join the group: rank 0 passes its store, followers the store's port."""
    if store is None:
        store = dist.TCPStore(LOOPBACK, port, tp.size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    if device.startswith("cuda"):  # NCCL binds each rank's communicator to its current device
        torch.cuda.set_device(rank_device(device, tp.rank))
    dist.init_process_group(backend_for(device), store=store, rank=tp.rank, world_size=tp.size,
                            timeout=COLLECTIVE_TIMEOUT)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
