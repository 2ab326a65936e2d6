"""A load's reads in one C call per thread (r8.c's qk_read_jobs): tensors copied as stored and tensors read straight
into the CPU kernels' interleaved layout, taken one after another by whichever thread is free, with the GIL free
from the first byte to the last. A per-tensor loop in Python needs the GIL between tensors, and the tokenizer's
build beside the load holds it for a second: the reading threads then waited their turn at every tensor (a
qwen35moe load's reads took 2-2.7 s beside it, 0.65-0.9 s alone; bench/journal/issue-36.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from moerun.kernels.cpu import QK_R8, _need, can_interleave_stored
from moerun.quant.qtypes import QType, row_bytes

JOB = 6  # int64 fields a job (matmul.h's QK_READ_JOB)
PENDING = -(1 << 63)  # a job not ended yet (QK_READ_PENDING)
SCRATCH_BYTES = 512 << 10  # a reading thread's buffer for the tensors repacked as read: L2-sized


@dataclass(frozen=True)
class Read:
    """Bytes [offset, offset + dst's size) of the open file `fd` into `dst` (a contiguous CPU uint8 tensor), as
    stored, or with `interleave` the rows of a GGUF tensor of that type and `shape`, repacked on the way."""

    fd: int
    offset: int
    dst: torch.Tensor
    interleave: QType | None = None
    shape: tuple[int, ...] = ()


def read_all(reads: Sequence[Read], threads: int, progress: Callable[[int, int], None] | None = None,
             meanwhile: Callable[[], None] | None = None, poll: float = 0.1) -> list[int]:
    """Run `reads` on up to `threads` threads, each taking the next read not taken -> each read's result: its bytes
    read (fewer where the file ends first), or -1000 - errno where a read failed. progress(i, result): called on this
    thread for each read that has ended, looked for every `poll` seconds. meanwhile: run on this thread once the
    reading threads have started (the reads go on beside it: Python that holds the GIL in long native calls, as the
    tokenizer's build, cannot hold them up); its exception is raised once they have ended."""
    _need()
    from moerun.kernels.cpu import _cpu

    rows_of_jobs, need = [], SCRATCH_BYTES
    for r in reads:
        if not r.dst.is_contiguous() or r.dst.dtype != torch.uint8 or not r.dst.is_cpu:
            raise ValueError("a read's dst must be a contiguous CPU uint8 tensor")
        if r.interleave is None:
            rows_of_jobs.append((r.fd, r.offset, -1, r.dst.data_ptr(), r.dst.numel(), 0))
            continue
        rows, cols = math.prod(r.shape[:-1]), r.shape[-1]
        if not can_interleave_stored(r.interleave, r.shape) or r.dst.numel() != rows * row_bytes(r.interleave, cols):
            raise ValueError(f"cannot read {r.interleave.name}{tuple(r.shape)} interleaved into {r.dst.numel()} bytes")
        need = max(need, 8 * row_bytes(r.interleave, cols))
        rows_of_jobs.append((r.fd, r.offset, int(r.interleave) + QK_R8, r.dst.data_ptr(), rows, cols))
    n = len(rows_of_jobs)
    jobs = torch.tensor(rows_of_jobs, dtype=torch.int64).reshape(n, JOB)
    done = torch.full((n,), PENDING, dtype=torch.int64)
    taken = torch.zeros(1, dtype=torch.int64)
    scratch = [torch.empty(need, dtype=torch.uint8) for _ in range(max(1, min(threads, n)))]

    def run(buf: torch.Tensor) -> None:
        _cpu.read_jobs(jobs.data_ptr(), n, taken.data_ptr(), done.data_ptr(), buf.data_ptr(), buf.numel())

    told = [False] * n
    with ThreadPoolExecutor(max_workers=len(scratch), thread_name_prefix="moerun-read") as pool:
        futures = [pool.submit(run, buf) for buf in scratch]
        if meanwhile is not None:
            meanwhile()  # on an exception, leaving the pool's block waits for the reads (they write into dst)
        while progress is not None:
            finished = all(f.done() for f in futures)
            for i, rc in enumerate(done.tolist()):  # an entry changes once, from PENDING to the result
                if rc != PENDING and not told[i]:
                    told[i] = True
                    progress(i, rc)
            if finished:
                break
            wait(futures, timeout=poll)
        for f in futures:
            f.result()
    return done.tolist()
