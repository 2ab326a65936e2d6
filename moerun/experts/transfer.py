"""Expert bytes from the home tier to a device stage: page-ins into cache slots, and the prefill stream.

An expert is three contiguous slices (gate | up | down) of its layer's stacks, copied into one contiguous
device buffer (DESIGN decision 2). From pinned host RAM that is three asynchronous copies on the copy
stream. From the file (or RAM that could not be pinned) it goes through one of a few pinned staging
buffers: read there (pread, or a host copy), then copied; a staging buffer is reused only once its copy is
done. Never a pageable host-to-device copy: that would be synchronous and stall both streams.

Ordering, by events (moerun.device): copies queued for a layer start after the compute that last read that
layer's slots (`after`); the compute stream waits for the copies' event before it reads them. Each batch
of copies is timed by events on the copy stream and each wait on the compute stream too; the figures are
read back (`settle`) once the events are done, so nothing here blocks the host but a staging reuse.

On the CPU stand-in the same calls run: copies are synchronous, events wall-clock stamps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moerun import device
from moerun.experts.stats import CacheStats
from moerun.experts.store import Expert, ExpertStore

N_STAGING = 4  # pinned staging buffers for experts read from the file: reads overlap the copies before them


@dataclass
class _Timed:
    layer: int
    phase: str
    kind: str  # "copy" (seconds_copy) or "stall" (seconds_stalled)
    start: device.Event
    end: device.Event


class Transfers:
    """The copy stream of one device stage and everything that feeds it (module docstring)."""

    def __init__(self, store: ExpertStore, dev: device.Device, pinned_layers: set[int]):
        self.store, self.dev = store, dev
        self.pinned_layers = pinned_layers  # layers whose experts sit in page-locked host memory
        self.copy = device.Stream(dev)
        self.compute = device.compute_stream(dev)
        self._staging: list[tuple[torch.Tensor, device.Event | None]] = []
        self._next = 0
        self._timed: list[_Timed] = []

    def _stage(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A staging buffer of >= nbytes whose last copy is done (waits for it if need be)."""
        if self._staging and self._staging[0][0].numel() < nbytes:
            for _, ev in self._staging:  # larger experts than before: drop the buffers once they are free
                if ev is not None:
                    ev.synchronize()
            self._staging.clear()
        size = self._staging[0][0].numel() if self._staging else nbytes
        while len(self._staging) < N_STAGING:
            self._staging.append((device.pinned_empty(size, self.dev), None))
        i, self._next = self._next, (self._next + 1) % N_STAGING
        buf, ev = self._staging[i]
        if ev is not None:
            ev.synchronize()
        return i, buf[:nbytes]

    def load(self, layer: int, experts: list[tuple[int, torch.Tensor]], phase: str,
             after: device.Event | None = None) -> tuple[int, device.Event]:
        """Queue each (expert id, device buffer) copy on the copy stream, after `after` -> (bytes, ready)."""
        if after is not None:
            self.copy.wait(after)
        start = device.Event(self.dev, timing=True).record(self.copy)
        total = 0
        for e, dst in experts:
            if layer in self.pinned_layers:
                src, off = self.store.get(layer, e), 0
                for t in (src.gate, src.up, src.down):
                    device.copy_(dst[off:off + t.nbytes], t.data.reshape(-1), self.copy)
                    off += t.nbytes
                total += off
                continue
            i, buf = self._stage(dst.numel())
            n = self.store.read_into(layer, e, buf)  # pread from the file, or a host copy from where it lives
            device.copy_(dst[:n], buf[:n], self.copy)
            self._staging[i] = (self._staging[i][0], device.Event(self.dev).record(self.copy))
            total += n
        ready = device.Event(self.dev, timing=True).record(self.copy)
        self._timed.append(_Timed(layer, phase, "copy", start, ready))
        return total, ready

    def wait(self, ready: device.Event, layer: int, phase: str) -> None:
        """The compute stream waits for `ready`; how long it stalls is timed between two events around it."""
        before = device.Event(self.dev, timing=True).record(self.compute)
        self.compute.wait(ready)
        self._timed.append(_Timed(layer, phase, "stall", before, device.Event(self.dev, timing=True).record(
            self.compute)))

    def mark(self) -> device.Event:
        """An event after the compute queued so far (what a later copy into the same buffers waits for)."""
        return device.Event(self.dev).record(self.compute)

    def adopt(self) -> None:
        """Buffers were just allocated from the compute stream's pool: the copy stream's later work waits for the
        compute queued before them (their memory's previous owner may still be read by it)."""
        self.copy.wait(self.mark())

    def settle(self, stats: CacheStats, wait: bool = False) -> None:
        """Add the timed copies and stalls whose events are done (all of them with `wait`) to `stats`."""
        keep = []
        for t in self._timed:
            if wait:
                t.end.synchronize()
            elif not t.end.query():
                keep.append(t)
                continue
            seconds = t.start.seconds_to(t.end)
            if t.kind == "copy":
                stats.add(t.layer, t.phase, seconds_copy=seconds)
            else:
                stats.add(t.layer, t.phase, seconds_stalled=seconds)
        self._timed = keep


class StreamBuffer:
    """The prefill stream of one device stage: two halves of `chunk` expert buffers on the device. Experts
    that a prompt chunk needs and the cost model sends over the link pass through it in chunks, one half
    filled on the copy stream while the other is computed with, without evicting any cache slot."""

    def __init__(self, transfers: Transfers, chunk: int):
        self.t, self.chunk = transfers, chunk
        self._halves: list[torch.Tensor] = []
        self._free: list[device.Event | None] = [None, None]  # compute done with each half

    def _buffers(self, nbytes: int) -> list[torch.Tensor]:
        if not self._halves or self._halves[0].shape[1] < nbytes:
            # the old halves go first: compute, their allocating stream, waited for every copy into them
            self._halves = []
            self._halves = [device.empty(self.t.dev, self.chunk * nbytes).view(self.chunk, nbytes) for _ in (0, 1)]
            self._free = [None, None]
            self.t.adopt()
        return self._halves

    def run(self, layer: int, experts: list[int], phase: str) -> Iterator[tuple[dict[int, Expert], int]]:
        """Yield ({expert: its views in the buffer}, bytes) chunk by chunk, each ready for compute queued after
        the yield; the next chunk's copies are queued before that compute, into the other half."""
        if not experts:
            return
        store, nbytes = self.t.store, self.t.store.expert_bytes(layer)
        halves, like = self._buffers(nbytes), store.get(layer, 0)
        chunks = [experts[i:i + self.chunk] for i in range(0, len(experts), self.chunk)]

        def issue(n: int):
            half = halves[n % 2]
            pairs = [(e, half[j][:nbytes]) for j, e in enumerate(chunks[n])]
            return self.t.load(layer, pairs, phase, after=self._free[n % 2])

        pending = [issue(0)] + ([issue(1)] if len(chunks) > 1 else [])
        for n in range(len(chunks)):
            size, ready = pending[n]
            self.t.wait(ready, layer, phase)
            half = halves[n % 2]
            yield {e: Expert.from_buffer(half[j][:nbytes], like) for j, e in enumerate(chunks[n])}, size
            self._free[n % 2] = self.t.mark()
            if n + 2 < len(chunks):
                pending.append(issue(n + 2))
