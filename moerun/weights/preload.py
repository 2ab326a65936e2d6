"""A load's reads, started before the loader knows the model.

`moerun run`, `serve` and `bench` call `weights_ahead` first, before torch's import: 1-1.6 s of a 2-3 s load on this
project's 2-core VM, with one core busy and the other idle. For a GGUF file it parses the header's tensors (no torch;
the vocabulary is stepped over, and parsed when the loader asks for the whole file), takes memory for every tensor
from an arena in file order, and starts reading each tensor into it on the threads the load reads on, in the layout
the loader will ask for: the CPU kernels' interleaved one where they take the tensor. The copies and their fresh
pages' faults then happen while torch imports. The loader `claim`s each read it would have made (same file, offset,
size and layout) and reads itself what was not foreseen; `finish` waits, the tokenizer built meanwhile. What nobody
claimed is skipped where no thread has started it, and its pages go back.

The foresight is the loader's own rule (`read_layout`) for a model whose every tensor is copied, which is when the
commands call it (RuntimeConfig.copies_whole_model: one process on the CPU, the file fitting in RAM).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moerun.errors import ModelFormatError
from moerun.formats.gguf import read_gguf
from moerun.formats.records import ModelFile, TensorRecord
from moerun.hostmem import ALIGN, Arena, copies_arena, weights_arena
from moerun.kernels import native
from moerun.quant.ggml_types import QType

if TYPE_CHECKING:
    import torch

# read a row at a time in the file's layout, never by the interleaved kernels: the embeddings (a row a token) and
# MLA's W_UK / W_UV (a head's rows, dequantized in registers by the fused decode, or float32 copies)
GGUF_LAYOUT_ONLY = ("token_embd.weight", "attn_k_b.weight", "attn_v_b.weight")


def read_layout(kind: str, qtype: QType, shape: tuple[int, ...], isa: str | None) -> QType | None:
    """The layout a copy of a stored tensor (canonical `kind`) is read into: its type's interleaved one where the
    kernels of `isa` take it, or None (as stored; isa None: no repacking)."""
    return qtype if kind not in GGUF_LAYOUT_ONLY and native.interleaves_stored(qtype, shape, isa) else None


def stored_kind(name: str) -> str:
    """A GGUF tensor name without its layer: "blk.3.attn_q.weight" -> "attn_q.weight"."""
    return re.sub(r"^blk\.\d+\.", "", name)


@dataclass(frozen=True)
class _Piece:
    name: str
    job: int
    start: int  # in the arena
    nbytes: int
    layout: QType | None


class Preload:
    """The reads weights_ahead started from the file's tensors (its header parsed without the vocabulary); arena: the
    memory the reads fill, and the loader's other copies take from while it has room."""

    def __init__(self, tensors: ModelFile, arena: Arena, jobs: native.ReadJobs, pieces: dict[tuple[Path, int], _Piece],
                 fds: list[int]):
        self.arena, self._tensors, self._mf = arena, tensors, None
        self._jobs, self._pieces, self._fds = jobs, pieces, fds
        self._claimed: set[int] = set()
        self._closed = False

    @property
    def mf(self) -> ModelFile:
        """The file parsed whole, for the load (which then owns it): its header read again, vocabulary and all, when
        the loader first asks (after torch's import, while the reads go on)."""
        if self._mf is None:
            self._tensors.close()
            self._mf = read_gguf(self._tensors.path)
        return self._mf

    @property
    def held(self) -> int:
        """Memory this process holds for the weights, free for the plan as for the load: the pieces reserved (the
        reads fill them while the plan is made)."""
        return sum(p.nbytes for p in self._pieces.values())

    @property
    def unclaimed(self) -> list[str]:
        """The tensors read ahead that no claim has taken (yet)."""
        return [p.name for p in self._pieces.values() if p.job not in self._claimed]

    def claim(self, rec: TensorRecord, layout: QType | None) -> tuple[int, torch.Tensor] | None:
        """The read of `rec` in `layout` if one was started -> (its job, for finish()'s results; the bytes it fills),
        once; None otherwise (the caller reads it)."""
        p = self._pieces.get((rec.file, rec.offset))
        if self._closed or p is None or p.job in self._claimed or p.nbytes != rec.nbytes or p.layout != layout:
            return None
        self._claimed.add(p.job)
        return p.job, self.arena.piece(p.start, p.nbytes)

    def finish(self, progress: Callable[[int, int], None] | None = None,
               meanwhile: Callable[[], None] | None = None) -> list[int]:
        """Once every read is claimed: the unclaimed skipped where not started, threads added up to the load's (where
        fewer were started), and every job's result once they have ended (native.ReadJobs.wait, whose meanwhile and
        progress these are)."""
        for p in self._pieces.values():
            if p.job not in self._claimed:
                self._jobs.skip(p.job)
        self._jobs.start(native.read_threads() - self._jobs.threads)
        return self._jobs.wait(progress, meanwhile)

    def close(self) -> None:
        """End the reads (those not started are not), give back the pieces nobody claimed and what the arena has
        left, close the files."""
        if self._closed:
            return
        self._closed = True
        self._jobs.cancel()
        self._jobs.join()
        for p in self._pieces.values():
            if p.job not in self._claimed:
                self.arena.release(p.start, p.nbytes)
        for fd in self._fds:
            os.close(fd)
        if self._mf is None:
            self._tensors.close()
        self.arena.close()


def weights_ahead(path: Path, repack: bool = True) -> Preload | Arena | None:
    """What a load that copies the whole file at `path` can start before torch's import: the reads (a Preload) where
    the CPU kernels are built, else an arena faulted in ahead (hostmem.weights_arena); None for other formats, a file
    that cannot be read or parsed (the load says why) or does not fit in RAM. repack: the loader reads into the
    kernels' interleaved layouts (--repack)."""
    kmode = native.mode()
    ext, _ = native.load(kmode)
    if ext is None:
        return weights_arena(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
        mf = read_gguf(path, strings=False)  # the tensors: the vocabulary waits for the loader (Preload.mf)
    except (OSError, ModelFormatError):
        return None
    try:
        return _start(mf, ext, native.default_isa(ext, kmode) if repack else None)
    except BaseException:
        mf.close()
        raise


def _start(mf: ModelFile, ext, isa: str | None) -> Preload | None:
    records = sorted(mf.records.values(), key=lambda r: (str(r.file), r.offset))
    arena = copies_arena(sum(-(-r.nbytes // ALIGN) * ALIGN for r in records), fault=False)
    if arena is None:
        mf.close()
        return None
    fds: dict[Path, int] = {}
    try:
        pieces, jobs = {}, []
        for r in records:
            if r.file not in fds:
                fds[r.file] = os.open(r.file, os.O_RDONLY)
            start = None if (r.file, r.offset) in pieces else arena.reserve(r.nbytes)
            if start is None:
                continue
            layout = read_layout(stored_kind(r.name), r.qtype, r.shape, isa)
            pieces[(r.file, r.offset)] = _Piece(r.name, len(jobs), start, r.nbytes, layout)
            jobs.append(native.read_job(fds[r.file], r.offset, arena.address(start), r.nbytes, layout, r.shape))
    except OSError:
        for fd in fds.values():
            os.close(fd)
        arena.close()
        mf.close()
        return None
    table = native.ReadJobs(ext, jobs, keep=arena)
    table.start(native.read_threads())  # with the import: on 2 cores one shares its core (the entry of 16662be)
    return Preload(mf, arena, table, pieces, list(fds.values()))
