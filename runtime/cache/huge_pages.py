"""Large CPU tensors on transparent huge pages (2 MiB) rather than 4 KiB ones.

Batch-1 decode streams every weight once a step, and attention reads KV rows scattered over the pool. On 4 KiB
pages the default model's bfloat16 weights span ~66,000 pages, and the page walk misses the TLB every few
kilobytes: a 270 MB bfloat16 matrix times a vector took 9.6 ms on 4 KiB pages and 8.8 ms on huge pages (AMD EPYC
Zen 5, 2 threads, medians of 30 alternating runs).

Most distributions set THP to "madvise": a region gets huge pages only when asked. A tensor about to be filled
(the KV pool) is asked before its first write (MADV_HUGEPAGE), so its pages fault in as huge ones; a tensor already
written (the loaded weights, or pages the allocator reused) is collapsed in place (MADV_COLLAPSE, Linux 6.1 on;
~70 ms for 270 MB). Where the kernel lacks MADV_COLLAPSE, the MADV_HUGEPAGE advice still lets khugepaged collapse
it later; where THP is off, nothing changes. Only whole 2 MiB pages inside a tensor's storage are asked for, so no
neighbouring allocation changes. FURCATE_HUGE_PAGES=0 leaves memory as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Iterable

import torch

logger = logging.getLogger("furcate.huge_pages")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


def enabled() -> bool:
    return os.environ.get("FURCATE_HUGE_PAGES", "1") != "0"


@functools.cache
def _madvise():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    function = getattr(libc, "madvise", None)
    if function is not None:
        function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function


def whole_pages(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The 2 MiB-aligned span inside a CPU tensor's storage: (start, bytes), or None where there is none (small,
    not on the CPU, or an opaque tensor without storage)."""
    if tensor.device.type != "cpu":
        return None
    try:
        storage = tensor.untyped_storage()
        first, size = storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):  # opaque (oneDNN-packed) tensors have no storage to reach
        return None
    start, end = -(-first // HUGE_PAGE) * HUGE_PAGE, (first + size) // HUGE_PAGE * HUGE_PAGE
    return (start, end - start) if end > start else None


def advise(tensors: Iterable[torch.Tensor], advice: int) -> int:
    """madvise each tensor's whole huge pages once (tensors sharing a storage count once); the bytes advised
    without an error."""
    function = _madvise()
    if function is None or not enabled():
        return 0
    spans = {span for span in map(whole_pages, tensors) if span is not None}
    done = 0
    for start, size in spans:
        if function(start, size, advice) == 0:
            done += size
        else:  # EINVAL: THP off, or no MADV_COLLAPSE before Linux 6.1; EAGAIN / ENOMEM: no huge page free now
            logger.debug("madvise(%d) of %d bytes: errno %d", advice, size, ctypes.get_errno())
    return done


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Put written tensors on huge pages now where the kernel can (and ask for them later where it cannot); the
    bytes collapsed."""
    tensors = list(tensors)
    advise(tensors, MADV_HUGEPAGE)
    collapsed = advise(tensors, MADV_COLLAPSE)
    logger.info("%.0f MB of weights on huge pages", collapsed / 1e6)
    return collapsed


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on the CPU, its pages asked to be huge before the zeros first touch them, and collapsed after
    where the allocator handed back pages already touched (freed memory it kept)."""
    tensor = torch.empty(shape, dtype=dtype, device="cpu")
    advise([tensor], MADV_HUGEPAGE)
    tensor.zero_()
    advise([tensor], MADV_COLLAPSE)
    return tensor
