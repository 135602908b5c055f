"""The process group an RL trainer broadcasts new weights in: the trainer is rank 0, the engine's ranks follow.

It is made the way SGLang's `init_custom_process_group` makes it (a tcp:// rendezvous at the trainer's address,
a store prefixed with the group's name, torch's own group constructor), so a trainer written for SGLang joins
furcate's engine unchanged; trainers may call init_weight_group too. The group lives beside any tensor-parallel
group of this process and never becomes the default group. Every wait (rendezvous, connecting, each broadcast)
is bounded by the timeout the caller gave: a trainer that never joins or dies fails the call, not the engine.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


def init_weight_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str = "gloo", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0, the trainer) the group; returns once every rank has joined."""
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{_bracketed(master_address)}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def receive_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Fill `tensor` with the trainer's (rank 0's) broadcast of it."""
    dist.broadcast(tensor, src=0, group=group)


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
