"""Large CPU tensors on transparent huge pages (runtime/cache/huge_pages.py): the KV pool's zeros fault in as huge
pages, loaded weights collapse into them, and nothing changes where the switch or the kernel says no."""

from __future__ import annotations

import pathlib

import pytest
import torch

from furcate.runtime.cache import huge_pages
from furcate.runtime.cache.memory_pool import TokenToKVPool

MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP = MODE.is_file() and "[never]" not in MODE.read_text()
needs_thp = pytest.mark.skipif(not THP, reason="transparent huge pages are off (or absent) on this machine")


def huge_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings the tensor's storage overlaps (/proc/self/smaps; advice splits a mapping at
    the advised range's ends)."""
    first = tensor.untyped_storage().data_ptr()
    last, total, inside = first + tensor.untyped_storage().nbytes(), 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start < last and first < end
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


@needs_thp
def test_zeros_fault_in_as_huge_pages():
    tensor = huge_pages.zeros((16 << 20) // 4, torch.float32)
    assert tensor.eq(0).all() and huge_bytes(tensor) >= 12 << 20  # all whole 2 MiB pages inside it


@needs_thp
def test_the_kv_pool_is_on_huge_pages():
    pool = TokenToKVPool(20000, 2, 3, 64, torch.bfloat16, "cpu")  # 7.7 MB a buffer
    assert all(huge_bytes(buffer) >= 4 << 20 for buffer in pool.k_buffer + pool.v_buffer)


def can_collapse() -> bool:
    """Whether this kernel collapses pages in place (MADV_COLLAPSE, Linux 6.1 on), asked of a scratch tensor."""
    scratch = torch.ones((4 << 20) // 4)
    start, size = huge_pages.whole_pages(scratch)
    return huge_pages._madvise()(start, size, huge_pages.MADV_COLLAPSE) == 0


@needs_thp
def test_written_tensors_collapse_with_their_values():
    if not can_collapse():
        pytest.skip("this kernel cannot collapse pages in place (MADV_COLLAPSE: Linux 6.1 on)")
    tensor = torch.arange((32 << 20) // 4, dtype=torch.float32)
    assert huge_pages.collapse([tensor, tensor[5:]]) >= 28 << 20  # a view of the same storage counts once
    assert huge_bytes(tensor) >= 28 << 20
    assert torch.equal(tensor, torch.arange((32 << 20) // 4, dtype=torch.float32))


def test_small_and_opaque_tensors_are_left_alone():
    assert huge_pages.whole_pages(torch.zeros(1000)) is None
    assert huge_pages.whole_pages(torch.zeros(0)) is None
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(2048, 1024), None)  # oneDNN's opaque layout
    assert huge_pages.whole_pages(packed) is None
    assert huge_pages.collapse([torch.zeros(1000), packed]) == 0


def test_whole_pages_lie_inside_the_storage():
    tensor = torch.empty((9 << 20) // 4)
    start, size = huge_pages.whole_pages(tensor)
    first = tensor.untyped_storage().data_ptr()
    assert start % huge_pages.HUGE_PAGE == 0 and size % huge_pages.HUGE_PAGE == 0 and size >= 6 << 20
    assert first <= start and start + size <= first + tensor.untyped_storage().nbytes()


def test_switched_off_nothing_is_advised(monkeypatch):
    monkeypatch.setenv("FURCATE_HUGE_PAGES", "0")
    assert huge_pages.collapse([torch.ones((8 << 20) // 4)]) == 0
