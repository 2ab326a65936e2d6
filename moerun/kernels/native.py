"""What of the C extension moerun.kernels._cpu runs without torch: loading it as MOERUN_KERNELS says, the rule for
which tensors in a file's layout the interleaved layouts take, and a load's read jobs (r8.c's qk_read_jobs) over
numpy arrays. cpu.py (the torch side) builds on it; moerun.weights.preload uses it to start a load's reads before
torch is imported, an import that takes 1-1.6 s of a 2-3 s load on this project's 2-core VM."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from moerun.quant.ggml_types import INTERLEAVABLE, QType, row_bytes

QK_R8 = 1000  # qk.h: an interleaved layout's type id is the ggml type's + QK_R8
JOB = 6  # int64 fields a job (matmul.h's QK_READ_JOB)
PENDING = -(1 << 63)  # a job not ended yet (QK_READ_PENDING)
SCRATCH_BYTES = 512 << 10  # a reading thread's buffer for the tensors repacked as read: L2-sized
# interleaved layouts with only the portable kernel in a set whose GGUF-layout kernel is vectorized: kept in GGUF's
# layout where that set runs
KEEP_GGUF = {"neon": frozenset({QType.Q6_K, QType.IQ4_XS, QType.IQ4_NL, QType.Q3_K})}


def mode() -> str:
    """MOERUN_KERNELS: "" / "auto", "scalar" (the portable kernels) or "off" (no extension)."""
    return os.environ.get("MOERUN_KERNELS", "").strip().lower()


def load(mode: str) -> tuple[ModuleType | None, str | None]:
    """The extension as MOERUN_KERNELS's `mode` asks -> (the module or None, why not)."""
    if mode == "off":
        return None, "disabled by MOERUN_KERNELS=off"
    if mode not in ("", "auto", "scalar"):
        return None, f"MOERUN_KERNELS={mode!r} is not one of auto, scalar, off"
    try:
        from moerun.kernels import _cpu
    except ImportError as e:  # not built (e.g. a source tree without `pip install -e .`)
        return None, f"moerun.kernels._cpu is not built: {e}"
    return _cpu, None


def default_isa(ext: ModuleType | None, mode: str) -> str | None:
    """The kernel set calls use: the best this CPU runs, or "scalar" where the mode says so (None: no extension)."""
    return None if ext is None else "scalar" if mode == "scalar" else ext.features()["best"]


def interleaves_stored(qtype: QType, shape: tuple[int, ...], isa: str | None) -> bool:
    """Whether the kernels of `isa` take a tensor of that type and shape in the interleaved layout, read straight
    from a file (GGUF's layout): Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS, Q5_0, Q5_1 or IQ4_NL, 2 or 3 dimensions, rows a multiple of
    8 (Q6_K and IQ4_XS only where that set has a vectorized interleaved dot: x86)."""
    return (isa is not None and 8 in INTERLEAVABLE.get(qtype, ()) and qtype not in KEEP_GGUF.get(isa, ())
            and len(shape) in (2, 3) and shape[-2] % 8 == 0)


def read_threads() -> int:
    """Threads a load reads on: positioned reads release the GIL, and a few at once keep the copies and the new
    pages' faults on every core."""
    return max(1, min(4, os.cpu_count() or 1))


def read_job(fd: int, offset: int, dst: int, nbytes: int, interleave: QType | None = None,
             shape: tuple[int, ...] = ()) -> tuple[int, ...]:
    """One job of a ReadJobs table: `nbytes` at `offset` of the open file `fd` into the address `dst`, as stored, or
    with `interleave` the rows of a GGUF tensor of that type and `shape` (nbytes its size), repacked on the way."""
    if interleave is None:
        return (fd, offset, -1, dst, nbytes, 0)
    return (fd, offset, int(interleave) + QK_R8, dst, math.prod(shape[:-1]), shape[-1])


class ReadJobs:
    """A load's reads as one table (r8.c's qk_read_jobs): each thread `start` adds makes one C call and, with the GIL
    free throughout, takes the next job nobody has taken until none is left, so threads added later share the work
    of those already reading. `done[i]`: job i's result once it has ended (PENDING before): its bytes read (fewer
    where the file ended first) or -1000 - errno. The threads are daemons: a process that ends with jobs left (an
    error before the load) does not wait for them, and `keep` (what the jobs write into) lives as long as they do."""

    def __init__(self, ext: ModuleType, jobs: Sequence[tuple[int, ...]], keep: Any = None):
        self._ext, self._keep = ext, keep
        # each thread's buffer: SCRATCH_BYTES, or 8 rows of the widest tensor repacked as read
        wide = [8 * row_bytes(QType(j[2] - QK_R8), j[5]) for j in jobs if j[2] >= 0]
        self._scratch_bytes = max([SCRATCH_BYTES, *wide])
        self.n = len(jobs)
        self._jobs = np.array(jobs, dtype=np.int64).reshape(self.n, JOB)
        self.done = np.full(self.n, PENDING, dtype=np.int64)
        self._next = np.zeros(1, dtype=np.int64)  # the next job to take (qk_read_jobs adds to it atomically)
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    @property
    def threads(self) -> int:
        return len(self._threads)

    def start(self, threads: int) -> None:
        """`threads` more reading threads (none past one a job)."""
        for _ in range(max(0, min(threads, self.n - len(self._threads)))):
            t = threading.Thread(target=self._run, name="moerun-read", daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self) -> None:
        scratch = np.empty(self._scratch_bytes, dtype=np.uint8)
        try:
            self._ext.read_jobs(self._jobs.ctypes.data, self.n, self._next.ctypes.data, self.done.ctypes.data,
                                scratch.ctypes.data, scratch.size)
        except BaseException as e:  # noqa: BLE001 - whatever the call raised, raised again by wait()
            self._errors.append(e)

    def skip(self, i: int) -> None:
        """Job i reads nothing if no thread has taken it yet (an aligned 8-byte store: a thread reads the old size
        or the new one, whole)."""
        self._jobs[i, 4] = 0

    def cancel(self) -> None:
        """No job starts from now on; the threads end after the jobs they are reading."""
        self._next[0] = self.n

    def wait(self, progress: Callable[[int, int], None] | None = None, meanwhile: Callable[[], None] | None = None,
             poll: float = 0.1) -> list[int]:
        """Every job's result once every thread has ended. meanwhile: run on this thread first, the reads going on
        beside it (Python that holds the GIL in long native calls, as the tokenizer's build, cannot hold them up); if
        it raises, the jobs not started are cancelled and the exception is raised once the threads have ended.
        progress(i, result): called on this thread for each job that has ended, looked for every `poll` seconds."""
        if self.n and not self._threads:
            self.start(1)
        try:
            if meanwhile is not None:
                meanwhile()
        except BaseException:
            self.cancel()
            self.join()
            raise
        told = np.zeros(self.n, dtype=bool)
        while True:
            running = [t for t in self._threads if t.is_alive()]
            if progress is not None:
                ended = np.flatnonzero((self.done != PENDING) & ~told)
                told[ended] = True
                for i in ended.tolist():
                    progress(i, int(self.done[i]))
            if not running:
                break
            running[0].join(poll if progress is not None else None)
        if self._errors:
            raise self._errors[0]
        return self.done.tolist()

    def join(self) -> None:
        for t in self._threads:
            t.join()
