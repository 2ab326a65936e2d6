"""Host memory for weights: large buffers on transparent huge pages, and --mlock. A leaf module (torch,
moerun.errors and moerun.sizes only), so the file readers, the weight loader, the expert store and cache and the
kernels can all use it.

A decode step streams hundreds of megabytes of weights through the kernels once each. On 4 KiB pages every
page is a TLB miss and a place where the hardware prefetchers stop; on 2 MiB pages neither happens. Measured
on this project's 2-core Zen 4 VM (bench/RESULTS.md): an interleaved Q4_K GEMV over a 75 MB matrix went
from 38 to 52 GB/s with 2 threads (partly from L3), over 604 MB from 32-34 to 37 GB/s in one window and
not at all in another; a3b-L12 Q4_K_M decode is 2-3% faster (median of 8 alternating pairs). Small, but
free: Linux gives huge pages to anonymous private memory that is advised so (`transparent_hugepage/enabled`
= madvise, the common default) or always; elsewhere the advice is a no-op and the buffer an ordinary one.
"""

from __future__ import annotations

import mmap

import torch

from moerun.errors import HostMemoryError

HUGE_PAGE = 2 << 20


def host_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised 1-D uint8 CPU tensor of `nbytes`, for weights the kernels stream.

    From 2 MiB up it is a private anonymous mapping of its own, advised MADV_HUGEPAGE and used from a 2 MiB
    boundary; pages are only faulted in when written, so the alignment slack costs address space, not
    memory. The mapping is unmapped when the last tensor viewing it is freed.
    """
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise HostMemoryError(f"cannot map {nbytes / 2**20:.1f} MiB of host memory for weights ({e.strerror or e}): "
                              "keep the experts in the file's map (--mmap), add an expert cache, or free memory") from None
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or refused: ordinary pages
        pass
    whole = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def lock_all() -> str | None:
    """Lock every page this process maps now in RAM (mlockall(MCL_CURRENT), llama.cpp's --mlock) -> None, or
    the line that says why the kernel refused (usually the locked-memory limit, RLIMIT_MEMLOCK)."""
    import ctypes
    import os
    import resource

    from moerun.sizes import format_size

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlockall(1) == 0:  # MCL_CURRENT
        return None
    err = ctypes.get_errno()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else format_size(soft)
    return (f"--mlock: the weights are not locked in RAM: {os.strerror(err)} (the locked-memory limit, ulimit -l, "
            f"is {limit})")
