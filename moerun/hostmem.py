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

import math
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
    buf = _mapped(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8) if buf is None else buf


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor (e.g. a KV cache): from 2 MiB up, host_empty's own mapping, whose pages read as zeros
    and are only faulted in when first written, so the pages a run never touches cost neither time nor memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = _mapped(nbytes)
    return torch.zeros(shape, dtype=dtype) if buf is None else buf.view(dtype).view(shape)


def _mapped(nbytes: int) -> torch.Tensor | None:
    """host_empty's mapping (zero-filled, as every new anonymous mapping), or None under 2 MiB or without madvise."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return None
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
