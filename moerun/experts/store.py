"""The home tier of routed experts: per (layer, expert) its gate, up and down weights as stored.

From a GGUF file the experts are stacked along the outermost dimension, so expert e's three tensors are
three contiguous slices of the memory map: the store hands out views, and a page-in is three copies.
`owned=True` copies each expert into one contiguous buffer of memory moerun owns (the page cache may
drop mmap pages at any time; DESIGN decision 10). A GPU stage page-locks the buffers it copies from in place
(moerun.device.pin).

A store over the memory map can be given an `ExpertReader` (built by the loader from the tensor records:
file, offset, bytes per expert): it reads an expert into a buffer with positioned reads (`os.preadv`), so
a cache miss never maps a file page into the process. Every page touched through the map counts in the process's resident set until the
kernel drops it; a read leaves the file's pages in the page cache only (the kernel's memory, shared,
not ours). No `posix_fadvise(DONTNEED)`: the page cache is shared with other readers of the file and
dropping it would only make the next miss go to disk.
"""

from __future__ import annotations

import copy
import os
import weakref
from dataclasses import dataclass

import torch

from moerun.errors import ModelFormatError
from moerun.hostmem import host_empty
from moerun.quant.qtypes import QTensor


@dataclass(frozen=True)
class Expert:
    gate: QTensor  # [I, H]
    up: QTensor  # [I, H]
    down: QTensor  # [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @staticmethod
    def from_buffer(buf: torch.Tensor, like: Expert) -> Expert:
        """Views of one contiguous uint8 buffer laid out gate | up | down, shaped like `like`."""
        parts, off = [], 0
        for t in (like.gate, like.up, like.down):
            parts.append(QTensor.from_bytes(buf[off:off + t.nbytes], t.qtype, t.shape, t.interleave))
            off += t.nbytes
        return Expert(*parts)

    def copy_into(self, buf: torch.Tensor) -> None:
        off = 0
        for t in (self.gate, self.up, self.down):
            buf[off:off + t.nbytes].copy_(t.data.reshape(-1))
            off += t.nbytes


@dataclass(frozen=True)
class FileSpan:
    """Where one stacked tensor (all experts of one of gate/up/down at one layer) starts in a file.
    Expert e's slice is `expert_nbytes` bytes at `offset + e * expert_nbytes`."""

    path: str
    offset: int
    expert_nbytes: int


def _stamp(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class ExpertReader:
    """Reads experts from their file into buffers moerun owns, without mapping the file.

    spans: layer -> (gate, up, down) FileSpans. The file descriptors stay open until `close()` or until
    the reader is collected, so a file replaced on disk is not read by mistake.
    """

    def __init__(self, spans: dict[int, tuple[FileSpan, FileSpan, FileSpan]]):
        self.spans = spans
        paths = sorted({s.path for parts in spans.values() for s in parts})
        self._fds: dict[str, int] = {}
        self._stamps: dict[str, tuple[int, int]] = {}  # (size, mtime) when opened: a change fails the reads
        try:
            for p in paths:
                self._fds[p] = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._stamps[p] = _stamp(self._fds[p])
        except OSError as e:
            _close_fds(list(self._fds.values()))
            raise ModelFormatError(e.filename, f"cannot open for reading experts: {e.strerror or e}") from None
        self._closer = weakref.finalize(self, _close_fds, list(self._fds.values()))
        self.ids: dict[int, list[int]] | None = None  # layer -> the file's id of each expert (a shard's)

    def close(self) -> None:
        self._closer()

    def shard(self, ids: dict[int, list[int]]) -> ExpertReader:
        """This reader for one rank's experts, numbered 0.. as `ids` (layer -> file ids) lists them, sharing the
        open files."""
        r = copy.copy(self)
        r._whole = self  # its files close when this reader goes
        r.ids = {layer: [e if self.ids is None else self.ids[layer][e] for e in v] for layer, v in ids.items()}
        return r

    def read_into(self, layer: int, e: int, buf: torch.Tensor) -> int:
        """Expert e of `layer` into `buf` (a contiguous CPU uint8 tensor, gate | up | down) -> bytes read.
        A file that ends early (truncated while in use), fails to read or was modified since it was opened
        raises ModelFormatError."""
        if not buf.is_cpu or not buf.is_contiguous() or buf.dtype != torch.uint8:
            raise ValueError("read_into needs a contiguous CPU uint8 buffer")
        e = e if self.ids is None else self.ids[layer][e]
        view, off = memoryview(buf.numpy()).cast("B"), 0
        for part, span in zip(("gate", "up", "down"), self.spans[layer]):
            n = span.expert_nbytes
            self._pread(span, view[off:off + n], span.offset + e * n, f"expert {e} of layer {layer} ({part})")
            off += n
        for path in {span.path for span in self.spans[layer]}:
            self._check_unchanged(path)
        return off

    def _check_unchanged(self, path: str) -> None:
        """The bytes just read are the model's only if the file is as it was when opened (same size and mtime);
        a file written over in place would otherwise give wrong weights silently."""
        (size, mtime), now = self._stamps[path], _stamp(self._fds[path])
        if now != (size, mtime):
            raise ModelFormatError(path, f"changed while in use (it had {size} bytes when opened, now {now[0]}, "
                                         "modified since): restart with the new file")

    def _pread(self, span: FileSpan, view: memoryview, pos: int, what: str) -> None:
        fd, done = self._fds[span.path], 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], pos + done)
            except OSError as e:
                raise ModelFormatError(span.path, f"cannot read {what}: {e.strerror or e}") from None
            if n == 0:
                raise ModelFormatError(span.path, f"truncated: {what} needs bytes {pos}..{pos + len(view)} but "
                                                  f"the file ends at {pos + done} (was it changed while in use?)")
            done += n


class ExpertStore:
    """reader: where the experts can be read from their file without the map (None: copy from the views);
    owned stores need none."""

    def __init__(self, gate: dict[int, QTensor], up: dict[int, QTensor], down: dict[int, QTensor],
                 owned: bool = False, reader: ExpertReader | None = None):
        self._stacks = {layer: (gate[layer], up[layer], down[layer]) for layer in gate}
        self._owned: dict[int, torch.Tensor] = {}
        if owned:
            for layer in self._stacks:
                E, nbytes = self.n_experts(layer), self.expert_bytes(layer)
                buf = host_empty(E * nbytes).view(E, nbytes)
                for e in range(E):
                    self._view(layer, e).copy_into(buf[e])
                self._owned[layer] = buf
        self.reader = None if owned else reader
        # Every expert's views, built once: the decode loop asks for k of them per layer and token.
        self._experts = {layer: [self._build(layer, e) for e in range(self.n_experts(layer))]
                         for layer in self._stacks}

    @property
    def layers(self) -> list[int]:
        return sorted(self._stacks)

    def subset(self, a: int, b: int) -> ExpertStore:
        """The same store restricted to layers [a, b) (one stage's), sharing the buffers and the reader."""
        s = copy.copy(self)
        s._stacks = {layer: v for layer, v in self._stacks.items() if a <= layer < b}
        s._owned = {layer: v for layer, v in self._owned.items() if a <= layer < b}
        s._experts = {layer: v for layer, v in self._experts.items() if a <= layer < b}
        return s

    def shard(self, ids: dict[int, list[int]]) -> ExpertStore:
        """One rank's experts under expert parallelism: layer -> the ids it owns (ascending), numbered 0.. in that
        order (expert_rows); the reader renumbered to match."""
        if self._owned:
            raise ValueError("an owned store cannot be sharded: shard the stacked tensors it was made from")
        parts = ({layer: expert_rows(self._stacks[layer][m], ids[layer]) for layer in self._stacks} for m in range(3))
        return ExpertStore(*parts, reader=None if self.reader is None else self.reader.shard(ids))

    def n_experts(self, layer: int) -> int:
        return self._stacks[layer][0].shape[0]

    def expert_bytes(self, layer: int) -> int:
        return sum(t.nbytes // t.shape[0] for t in self._stacks[layer])

    def _view(self, layer: int, e: int) -> Expert:
        g, u, d = self._stacks[layer]
        return Expert(g[e], u[e], d[e])

    def _build(self, layer: int, e: int) -> Expert:
        if layer in self._owned:
            return Expert.from_buffer(self._owned[layer][e], self._view(layer, e))
        return self._view(layer, e)

    def stacks(self, layer: int) -> tuple[QTensor, QTensor, QTensor] | None:
        """All experts of `layer` as the stacked (gate, up, down) tensors they are read from, or None for an
        owned store (which holds them in buffers of its own)."""
        return None if layer in self._owned else self._stacks[layer]

    def get(self, layer: int, e: int) -> Expert:
        """Expert e where it lives (views of the map or of owned RAM)."""
        return self._experts[layer][e]

    def read_into(self, layer: int, e: int, buf: torch.Tensor) -> int:
        """Expert e into `buf` (laid out gate | up | down) -> bytes: read from the file when the store has
        a reader (the map's pages stay untouched), else copied from where it lives."""
        if self.reader is not None and buf.is_cpu:
            return self.reader.read_into(layer, e, buf)
        src = self.get(layer, e)
        src.copy_into(buf)
        return src.nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.expert_bytes(layer) * self.n_experts(layer) for layer in self._stacks)


def expert_rows(q: QTensor, ids: list[int]) -> QTensor:
    """Experts `ids` (ascending) of a stacked [E, ..] tensor as a stack of their own: a view when they are a
    range, else a copy of just those experts."""
    lo = ids[0] if ids else 0
    if ids == list(range(lo, lo + len(ids))):
        part = q.data[lo:lo + len(ids)]
    else:
        part = q.data.index_select(0, torch.tensor(ids, dtype=torch.long))
    return QTensor(part, q.qtype, (len(ids), *q.shape[1:]), q.interleave)
