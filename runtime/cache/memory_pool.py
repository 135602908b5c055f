"""The two KV memory pools: request slot -> KV slot indices, and KV slot -> K/V tensors per layer.

Page size is 1: any free KV slot can hold any token, so there is no fragmentation.

Where they live: the K/V buffers on the engine's device; the request table and every KV slot list (allocations,
radix cache values) on the host. Those are the scheduler's bookkeeping, written and read on every step; on a GPU
keeping them there would make each read a device sync. Attention backends copy what their kernels read of the
table once per batch, when they plan it (attention/base.py).
"""

from __future__ import annotations

import torch

from . import huge_pages


class ReqToTokenPool:
    """Row r lists, position by position, the KV slots of the request that holds row r."""

    def __init__(self, size: int, max_context_len: int) -> None:
        self.size = size
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device="cpu")
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class TokenToKVPool:
    """K and V buffers for every layer, indexed by KV slot, with a free-slot allocator.

    Buffers are token-major, [slots, num_kv_heads, head_dim], so gathering a batch's slots is one row
    gather of whole tokens (the fastest gather on CPU, several times faster than advanced indexing).
    Slot 0 is never handed out: padded index tensors point at it, so reads of padding stay in bounds
    and writes of padding never clobber a live token.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
    ) -> None:
        self.size = size
        self.device = torch.device(device)
        self.shape, self.dtype, self.num_layers = (size + 1, num_kv_heads, head_dim), dtype, num_layers
        self.restore()
        self.clear()

    def restore(self) -> None:
        """Allocate the buffers (again, after release); on the CPU on huge pages, where attention's scattered reads
        of KV rows miss the TLB less."""
        self.k_buffer = [self._zeros() for _ in range(self.num_layers)]
        self.v_buffer = [self._zeros() for _ in range(self.num_layers)]

    def _zeros(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return huge_pages.zeros(self.shape, self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Give the buffers' memory back (release_memory_occupation); only when no slot is in use."""
        if len(self._free) != self.size:
            raise RuntimeError(f"cannot release the KV pool: {self.size - len(self._free)} slots are in use")
        empty = torch.empty((0, *self.shape[1:]), dtype=self.dtype, device=self.device)
        self.k_buffer = [empty] * self.num_layers
        self.v_buffer = [empty] * self.num_layers

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, or None when fewer are free (the caller decides what to evict or retract)."""
        if n > len(self._free):
            return None
        # In slot order: frees leave the list shuffled, and a request whose slots run in order moves its K/V in
        # few large pieces (a prefill/decode transfer made 11x fewer writes per request with this).
        taken = sorted(self._free[len(self._free) - n :])
        del self._free[len(self._free) - n :]
        return torch.tensor(taken, dtype=torch.int64, device="cpu")

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free.extend(slots.tolist())

    def clear(self) -> None:
        # Popping from the end hands out low slot numbers first, which keeps early requests' KV together.
        self._free = list(range(self.size, 0, -1))

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, num_kv_heads, head_dim] for the given slots."""
        self.k_buffer[layer].index_copy_(0, slots, k)
        self.v_buffer[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of index [B, L] as [B, L, num_kv_heads, head_dim] each."""
        flat = index.reshape(-1)
        shape = (*index.shape, *self.k_buffer[layer].shape[1:])
        return (self.k_buffer[layer].index_select(0, flat).view(shape),
                self.v_buffer[layer].index_select(0, flat).view(shape))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
