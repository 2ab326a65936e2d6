"""Host memory for weights: large buffers on transparent huge pages, an arena faulted in ahead of a load, and
--mlock. A leaf module (torch, imported where tensors are made, moerun.errors and moerun.sizes only), so the file
readers, the weight loader, the expert store and cache and the kernels can all use it, and a command can start an
arena before torch's import.

A decode step streams hundreds of megabytes of weights through the kernels once each. On 4 KiB pages every
page is a TLB miss and a place where the hardware prefetchers stop; on 2 MiB pages neither happens. Measured
on this project's 2-core Zen 4 VM (bench/RESULTS.md): an interleaved Q4_K GEMV over a 75 MB matrix went
from 38 to 52 GB/s with 2 threads (partly from L3), over 604 MB from 32-34 to 37 GB/s in one window and
not at all in another; a3b-L12 Q4_K_M decode is 2-3% faster (median of 8 alternating pairs). Small, but
free: Linux gives huge pages to anonymous private memory that is advised so (`transparent_hugepage/enabled`
= madvise, the common default) or always; elsewhere the advice is a no-op and the buffer an ordinary one.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from moerun.errors import HostMemoryError

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
ALIGN = 64  # an arena's pieces start on a cache line


def host_empty(nbytes: int, arena: Arena | None = None) -> torch.Tensor:
    """An uninitialised 1-D uint8 CPU tensor of `nbytes`, for weights the kernels stream.

    Taken from `arena` while it has room. Otherwise, from 2 MiB up, a private anonymous mapping of its own, advised
    MADV_HUGEPAGE and used from a 2 MiB boundary; pages are only faulted in when written, so the alignment slack
    costs address space, not memory. The mapping is unmapped when the last tensor viewing it is freed.
    """
    import torch

    buf = arena.take(nbytes) if arena is not None else None
    if buf is None:
        buf = _mapped(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8) if buf is None else buf


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor (e.g. a KV cache): from 2 MiB up, host_empty's own mapping, whose pages read as zeros
    and are only faulted in when first written, so the pages a run never touches cost neither time nor memory."""
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    buf = _mapped(nbytes)
    return torch.zeros(shape, dtype=dtype) if buf is None else buf.view(dtype).view(shape)


def _mapped(nbytes: int) -> torch.Tensor | None:
    """host_empty's mapping (zero-filled, as every new anonymous mapping), or None under 2 MiB or without madvise."""
    import torch

    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    whole = torch.frombuffer(_huge_map(nbytes), dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def fits_in_ram(nbytes: int) -> bool:
    """Whether weights of `nbytes` are copied into RAM rather than left in the file's map: under 70% of the
    available memory (the page cache drops idle pages, so a model that fits is copied; DESIGN decision 10)."""
    import psutil

    return nbytes < 0.7 * psutil.virtual_memory().available


def _huge_map(nbytes: int) -> mmap.mmap:
    try:
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise HostMemoryError(f"cannot map {nbytes / 2**20:.1f} MiB of host memory for weights ({e.strerror or e}): "
                              "keep the experts in the file's map (--mmap), add an expert cache, or free memory") from None
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or refused: ordinary pages
        pass
    return m


class Arena:
    """Weight memory faulted in ahead of a load: one huge-page mapping of `nbytes` whose pages a thread of its own
    writes, one huge page at a time from the last down, from the moment it is made, while the process goes on with
    other work: a command makes it before torch's import, whose thread leaves the second core idle, and the loader's
    reads then write pages that are already there. A fresh page is the costly part of a load on a VM (the host backs
    it on first touch). The thread writes (a fault under the mapping's own lock) rather than asking the kernel to
    populate (MADV_POPULATE_WRITE holds the whole address space's lock, and every mmap the import and the tokenizer
    make waits behind it).

    take() hands out pieces from the start (the loader, before its reads), only below the huge page the thread
    is writing: the first piece that would reach it stops the thread (after that page) and the loader faults in the
    rest. close() ends the faulting and returns the pages nobody took to the system. The mapping lives as long as
    any piece of it.
    """

    def __init__(self, nbytes: int, chunk: int = HUGE_PAGE, fault: bool = True):
        self._map = _huge_map(nbytes)
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._lo = -self._addr % HUGE_PAGE  # offsets from here on huge-page boundaries every 2 MiB
        self._hi = self._lo + nbytes
        self._top = self._lo + -(-nbytes // PAGE) * PAGE  # the last page's end (within the map: _lo < HUGE_PAGE)
        self._next = self._lo  # the first byte not handed out
        self._floor = self._top  # the first byte the thread may be writing: pieces stay below it while it runs
        self._running = fault
        self._stop = False
        self._whole: torch.Tensor | None = None
        self._cond = threading.Condition()
        self.faulted = 0  # bytes the thread faulted in
        self._thread = threading.Thread(target=self._fault, args=(chunk,), name="moerun-arena", daemon=True)
        if fault:  # (without it, whoever takes the pieces writes the pages first: weights.preload's reads)
            self._thread.start()

    @property
    def nbytes(self) -> int:
        return self._hi - self._lo

    def _fault(self, chunk: int) -> None:
        end = self._top
        try:
            while True:
                with self._cond:
                    start = max(self._next, self._lo + (end - self._lo - 1) // chunk * chunk)
                    if self._stop or start >= end:
                        return
                    self._floor = start
                ctypes.memset(self._addr + start, 0, end - start)  # a foreign call: the GIL is free meanwhile
                self.faulted += end - start
                end = start
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _halt(self) -> None:
        """Stop the thread after the page it is writing (under self._cond)."""
        self._stop = True
        while self._running:
            self._cond.wait()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A piece of `nbytes` (on a cache line, as torch's own buffers: a page each would overflow a file's worth of
        arena by 4 KiB a tensor), or None when the arena is closed or has less room left."""
        start = self.reserve(nbytes)
        return None if start is None else self.piece(start, nbytes)

    def reserve(self, nbytes: int) -> int | None:
        """take() without torch: the piece's start (its memory at address(start); piece() makes it a tensor), or
        None."""
        with self._cond:
            if self._next + nbytes > self._hi or self._next >= self._top:
                return None
            if self._running and self._next + nbytes > self._floor:
                self._halt()  # the piece would reach pages the thread may be writing
            start, self._next = self._next, self._next + -(-nbytes // ALIGN) * ALIGN
            return start

    def address(self, start: int) -> int:
        return self._addr + start

    def piece(self, start: int, nbytes: int) -> torch.Tensor:
        """The uint8 tensor of a reserved piece."""
        import torch

        with self._cond:
            if self._whole is None:
                self._whole = torch.frombuffer(self._map, dtype=torch.uint8)
            return self._whole[start:start + nbytes]

    def release(self, start: int, nbytes: int) -> None:
        """Give a reserved piece nobody will use back to the system: its whole pages (those it shares with a
        neighbour stay)."""
        lo, hi = -(-start // PAGE) * PAGE, (start + nbytes) // PAGE * PAGE
        if hi > lo:
            try:
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except OSError:  # e.g. locked by --mlock: the pages stay
                pass

    def close(self) -> int:
        """No more pieces; the faulting thread stops after its page, and the pages past the last piece go back to
        the system -> the bytes given back."""
        with self._cond:
            self._halt()
            tail = self._lo + -(-(self._next - self._lo) // PAGE) * PAGE
            self._next = self._top  # a second close has nothing to give back
            self._whole = None
            if tail >= self._top:
                return 0
            try:
                self._map.madvise(mmap.MADV_DONTNEED, tail, self._top - tail)
            except OSError:  # e.g. locked by --mlock: the pages stay
                return 0
            return self._top - tail


def weights_arena(path: Path) -> Arena | None:
    """An Arena for the copies of a GGUF file's weights, started now, when the file fits in RAM (fits_in_ram); None for
    other formats, a path that cannot be read (the load says why), a file under 2 MiB or without madvise."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size if f.read(4) == b"GGUF" else 0
    except OSError:
        return None
    return copies_arena(size)


def copies_arena(nbytes: int, fault: bool = True) -> Arena | None:
    """An Arena of `nbytes` for a model's copies (faulted in by its thread with `fault`), or None: under 2 MiB,
    without madvise, when the copies would not fit in RAM (fits_in_ram) or there is no address space for it now (each
    copy then maps its own, and says so if that fails too)."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not fits_in_ram(nbytes):
        return None
    try:
        return Arena(nbytes, fault=fault)
    except HostMemoryError:
        return None


# glibc hands freed blocks of 128 KiB-32 MiB straight back to the kernel (mmap'd, or trimmed off the heap's top), so a
# prompt's temporaries (torch's outputs, the kernels' quantized rows and expert buffers) fault in fresh pages in every
# layer: 430,225 minor faults and 0.8 s of system time in one qwen3moe pp512 (bench/journal/issue-36.md, "A prompt's
# page faults"). Blocks up to 32 MiB (glibc's ceiling for this setting) from the heap, and up to 256 MiB of freed heap
# kept for the next ones, bring that to 0-3,648 a prompt (jemalloc and tcmalloc, which PyTorch's CPU guides suggest
# preloading, keep freed memory likewise).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Let glibc's malloc keep freed big blocks for reuse (mallopt), where the C library is glibc and the environment
    sets none of glibc's own MALLOC_*_ tunables (a user's setting stands). True where set."""
    if any(k in os.environ for k in GLIBC_MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1


def lock_all() -> str | None:
    """Lock every page this process maps now in RAM (mlockall(MCL_CURRENT), llama.cpp's --mlock) -> None, or
    the line that says why the kernel refused (usually the locked-memory limit, RLIMIT_MEMLOCK)."""
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
