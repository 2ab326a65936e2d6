"""moerun.hostmem.host_empty: weight buffers on transparent huge pages where Linux offers them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moerun.hostmem import HUGE_PAGE, PAGE, host_empty

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


FREED_BLOCKS = """
import ctypes, os, resource, sys
from moerun.hostmem import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # a layer's temporaries: three blocks of 8 MiB written, freed, asked for again
    ps = [libc.malloc(8 << 20) for _ in range(3)]
    for p in ps:
        ctypes.memset(p, 1, 8 << 20)
    for p in ps:
        libc.free(p)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or sys.platform != "linux", reason="glibc's malloc on Linux")
@pytest.mark.parametrize("given", [None, "131072"])
def test_freed_big_blocks_are_kept_for_reuse_a_users_glibc_setting_stands(given):
    """A model's load asks glibc to keep freed blocks of up to 32 MiB (a prompt's temporaries faulted in fresh pages
    every layer: 430,225 faults in a qwen3moe pp512): 20 rounds of three 8 MiB blocks fault their pages in once, not
    every round. Where the environment sets one of glibc's MALLOC_*_ tunables, moerun leaves malloc as it is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if given is not None:
        env["MALLOC_TRIM_THRESHOLD_"] = given
    runs = {}
    for mode in ("keep", "plain"):
        r = subprocess.run([sys.executable, "-c", FREED_BLOCKS, mode], capture_output=True, text=True, env=env,
                           timeout=60, check=True)
        kept, faults = r.stdout.split()
        runs[mode] = (kept, int(faults))
    pages = (8 << 20) // PAGE
    assert runs["plain"][1] >= 20 * pages  # glibc as it comes: the heap's top trimmed and faulted in again
    if given is None:
        assert runs["keep"] == ("True", runs["keep"][1]) and runs["keep"][1] <= 4 * pages
    else:
        assert runs["keep"][0] == "False" and runs["keep"][1] >= 20 * pages


def test_load_model_keeps_freed_blocks_where_the_kernels_run(monkeypatch):
    """load_model asks for it where the kernels run a model (and not for the torch reference)."""
    from moerun import loading

    calls = []
    monkeypatch.setattr(loading, "keep_freed_memory", lambda: calls.append(1))
    model = Path(loading.__file__).parent / "data" / "default-qwen3moe.gguf"
    loading.load_model(model, kernels=False)
    assert calls == []
    loading.load_model(model)
    assert calls == [1]
