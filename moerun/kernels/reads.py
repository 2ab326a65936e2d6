"""A load's reads in one C call per thread (r8.c's qk_read_jobs through native.ReadJobs): tensors copied as stored
and tensors read straight into the CPU kernels' interleaved layout, taken one after another by whichever thread is
free, with the GIL free from the first byte to the last. A per-tensor loop in Python needs the GIL between tensors,
and the tokenizer's build beside the load holds it for a second: the reading threads then waited their turn at every
tensor (a qwen35moe load's reads took 2-2.7 s beside it, 0.65-0.9 s alone; bench/journal/issue-36.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moerun.kernels.cpu import _need, can_interleave_stored
from moerun.kernels.native import ReadJobs, read_job
from moerun.quant.qtypes import QType, row_bytes


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
    read (fewer where the file ends first), -1000 - errno where a read failed, or the repack's error code (QK_E*,
    -1 to -999) where the extension refused the layout or shape. progress(i, result): called on this
    thread for each read that has ended, looked for every `poll` seconds. meanwhile: run on this thread once the
    reading threads have started (the reads go on beside it); its exception is raised once they have ended."""
    _need()
    from moerun.kernels.cpu import _cpu

    jobs = []
    for r in reads:
        if not r.dst.is_contiguous() or r.dst.dtype != torch.uint8 or not r.dst.is_cpu:
            raise ValueError("a read's dst must be a contiguous CPU uint8 tensor")
        if r.interleave is not None:
            rows, cols = math.prod(r.shape[:-1]), r.shape[-1]
            if not can_interleave_stored(r.interleave, r.shape) or r.dst.numel() != rows * row_bytes(r.interleave, cols):
                raise ValueError(f"cannot read {r.interleave.name}{tuple(r.shape)} interleaved into {r.dst.numel()} "
                                 "bytes")
        jobs.append(read_job(r.fd, r.offset, r.dst.data_ptr(), r.dst.numel(), r.interleave, r.shape))
    table = ReadJobs(_cpu, jobs, keep=reads)
    table.start(threads)
    return table.wait(progress, meanwhile, poll)
