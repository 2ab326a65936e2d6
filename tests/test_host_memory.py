"""moerun.hostmem.host_empty: weight buffers on transparent huge pages where Linux offers them."""

from __future__ import annotations

from pathlib import Path

import torch

from moerun.hostmem import HUGE_PAGE, host_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_eligible(addr: int) -> bool | None:
    """THPeligible of the mapping holding addr (None where smaps has no such field)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                for rest in lines[i + 1:]:
                    if rest.startswith("THPeligible:"):
                        return rest.split()[1] == "1"
                    if rest.startswith("VmFlags:"):  # the last field of a mapping's entry
                        break
    return None


def test_small_and_large_buffers_are_plain_writable_tensors():
    for n in (0, 100, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 5):
        t = host_empty(n)
        assert t.dtype == torch.uint8 and t.shape == (n,) and t.is_contiguous() and t.is_cpu
        if n:
            t.fill_(7)
            assert int(t[-1]) == 7 and int(t.sum()) == 7 * n
    big = host_empty(3 * HUGE_PAGE)
    assert big.data_ptr() % HUGE_PAGE == 0  # starts on a huge-page boundary


def test_large_buffers_are_advised_for_huge_pages():
    mode = THP.read_text() if THP.exists() else ""
    t = host_empty(4 * HUGE_PAGE)
    t.fill_(1)
    eligible = thp_eligible(t.data_ptr())
    if "[madvise]" in mode or "[always]" in mode:
        assert eligible is not False, "a 8 MiB weight buffer is not eligible for transparent huge pages"


def test_views_keep_the_mapping_alive():
    t = host_empty(2 * HUGE_PAGE)[HUGE_PAGE:]
    t.fill_(3)  # the tensor it was sliced from is gone; its mapping is not
    assert int(t[0]) == 3


def test_a_refused_mapping_is_a_one_line_error(monkeypatch):
    import mmap

    from moerun.errors import HostMemoryError, MoerunError

    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    try:
        host_empty(4 * HUGE_PAGE)
    except HostMemoryError as e:
        assert isinstance(e, MoerunError) and isinstance(e, MemoryError)
        assert "Cannot allocate memory" in str(e) and "8.0 MiB" in str(e)
    else:
        raise AssertionError("no error")
