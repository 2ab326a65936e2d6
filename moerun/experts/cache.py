"""Expert cache: fixed slots per layer on one compute device, over the home-tier ExpertStore.

A step asks for the distinct experts its tokens were routed to. Residents hit; a miss either pages the
expert into a slot (one contiguous buffer per slot, three copies) evicting the policy's victim, or is
computed where it lives (a bypass: when every slot is pinned by the same step, or during prefill when
`prefill="bypass"` keeps a long prompt from evicting the decode working set wholesale).

When the store can read from its file (`store.reader`), loads are read straight into their slot and
bypassed experts into scratch buffers, so the memory map is never touched and the process's resident
set stays the slots plus the scratch (the page cache holds the file, outside it). With `interleave` (the
runtime's --repack), what lands in a slot or a scratch buffer is rewritten into the CPU kernels' interleaved
layout on the way, the layout experts resident in RAM have: the kernels then sum in the same order whatever
the cache holds, so greedy output does not depend on the cache, and slots run at the interleaved kernels'
speed. The scratch grows to
the most experts one step bypassed at one layer (at most one layer's experts, during a long prefill);
its views are valid until the next `fetch`, which is how the forward pass uses them. Without a reader
(a store in owned RAM or of unknown origin) loads copy from where the expert lives and bypasses are
computed there, as before.

On a device stage (a GPU, or the CPU stand-in: moerun.device) the slots are device buffers and the forward
pass asks `place` instead of `fetch`: per missed expert the cost model's choice (`choose(expert, tokens)`)
says whether it is paged into a slot ("fetch") or computed at home by the CPU ("home"); during a bypassing
prefill, and when every slot is pinned by the step, a fetched miss passes through the stream buffer
(`stream`) instead of a slot. Copies run on the stage's copy stream (moerun.experts.transfer).

With ``prefetch=True`` a guess of a layer's experts (``prefetch(layer, guessed)``, from the forward pass a
layer ahead) is paged in by a background worker (moerun.experts.prefetch); ``fetch`` of that layer first
waits for it, then scores it (precision/recall). A lock guards the slot tables; the worker reads into its
slots outside the lock and only ever touches the guessed layer.

`usage` counts the experts each step asks for, per layer, decayed (moerun.experts.usage): the server's live view
colours its heat map by it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from moerun import device as _device
from moerun.experts.policy import SlotTable
from moerun.experts.prefetch import Prefetcher
from moerun.experts.stats import CacheStats
from moerun.experts.store import Expert, ExpertStore
from moerun.experts.transfer import StreamBuffer, Transfers
from moerun.experts.usage import ExpertUse
from moerun.placement.planner import STREAM_CHUNK
from moerun.quant.qtypes import QTensor

PREFILL_MODES = ("bypass", "cache")


@dataclass
class Placement:
    """Where one step's experts of one layer are computed (a device stage's `place`)."""

    on_device: dict[int, Expert] = field(default_factory=dict)  # hits: slot views, ready now
    paged: dict[int, Expert] = field(default_factory=dict)  # page-ins: slot views, ready after `ready`
    ready: _device.Event | None = None
    streamed: list[int] = field(default_factory=list)  # through the stream buffer (`ExpertCache.stream`)
    home: dict[int, Expert] = field(default_factory=dict)  # computed by the CPU where they live


def _relayout_parts(like: Expert) -> tuple[bool, bool, bool] | None:
    """Which of an expert's gate, up, down the CPU kernels read faster interleaved (None: none of them)."""
    try:
        from moerun.kernels import cpu
    except ImportError:
        return None
    if not cpu.available():
        return None
    parts = tuple(cpu.can_interleave(t) for t in (like.gate, like.up, like.down))
    return parts if any(parts) else None


def _like(like: Expert, parts: tuple[bool, bool, bool] | None) -> Expert:
    """`like` as a slot holds it: the interleaved parts marked so (the same bytes in the kernels' order)."""
    if not parts:
        return like
    return Expert(*(QTensor(t.data, t.qtype, t.shape, 8) if il else t
                    for t, il in zip((like.gate, like.up, like.down), parts)))


class ExpertCache:
    def __init__(self, store: ExpertStore, slots: int | dict[int, int], policy: str = "lru",
                 device: str | _device.Device = "cpu", prefill: str = "bypass", stats: CacheStats | None = None,
                 prefetch: bool = False, pinned_layers: set[int] | None = None, interleave: bool = False):
        """device: where the slots are ("cpu", or a device stage's "cuda:N" / "standin:N"); pinned_layers: a
        device stage's layers whose experts are in page-locked RAM (copied straight from there); interleave:
        host slots and scratch hold the CPU kernels' interleaved layout (module docstring)."""
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {prefill!r}")
        self.dev = _device.parse(device)
        self.store, self.device, self.prefill = store, self.dev.torch, prefill
        self.stats = stats or CacheStats()
        self.usage = ExpertUse({layer: store.n_experts(layer) for layer in store.layers})
        per_layer = slots if isinstance(slots, dict) else dict.fromkeys(store.layers, slots)
        self.tables: dict[int, SlotTable] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        for layer in store.layers:
            n = min(per_layer.get(layer, 0), store.n_experts(layer))
            if n > 0:
                self.tables[layer] = SlotTable(n, policy)
                nbytes = store.expert_bytes(layer)
                self.buffers[layer] = _device.empty(self.dev, n * nbytes).view(n, nbytes)
        self.transfers = self.streamer = None
        self._used: dict[int, _device.Event] = {}  # per layer: the compute that last read its slots
        self._unwaited: dict[int, _device.Event] = {}  # per layer: page-ins queued that compute has not waited for
        if self.dev.accelerator:
            self.transfers = Transfers(store, self.dev, set(pinned_layers or ()))
            self.transfers.adopt()  # the slots above came from the compute stream's pool
            self.streamer = StreamBuffer(self.transfers, STREAM_CHUNK)
        self._relayout = {layer: _relayout_parts(store.get(layer, 0)) for layer in store.layers} if (
            interleave and self.dev.kind == "cpu") else {}
        self._like = {layer: _like(store.get(layer, 0), self._relayout.get(layer)) for layer in store.layers}
        self._slots = {layer: [Expert.from_buffer(buf[i], self._like[layer]) for i in range(len(buf))]
                       for layer, buf in self.buffers.items()}  # each slot's views, built once
        self._scratch: list[torch.Tensor] = []  # CPU buffers for bypassed experts read from the file
        self._staging: dict[int, torch.Tensor] = {}  # per thread: an expert as read, before it is interleaved
        self._lock = threading.Lock()  # the slot tables, shared with the prefetch worker
        self.prefetcher = Prefetcher(self._prefetch_layer) if prefetch else None

    @property
    def prefetching(self) -> bool:
        return self.prefetcher is not None

    def close(self) -> None:
        """Stop the prefetch worker (after what it is doing)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def slots(self, layer: int) -> int:
        t = self.tables.get(layer)
        return 0 if t is None else t.slots

    def _slot(self, layer: int, slot: int) -> Expert:
        return self._slots[layer][slot]

    def _scratch_buffers(self, n: int, nbytes: int) -> list[torch.Tensor]:
        """n CPU buffers of at least nbytes each, reused step after step. All have one size, the largest asked
        for so far (layers' experts differ in size when their types do, as in Q4_K_M's Q6_K down layers)."""
        if self._scratch and self._scratch[0].numel() < nbytes:
            self._scratch.clear()
        size = self._scratch[0].numel() if self._scratch else nbytes
        while len(self._scratch) < n:
            self._scratch.append(torch.empty(size, dtype=torch.uint8))
        return [b[:nbytes] for b in self._scratch[:n]]

    def _home(self, layer: int, experts: list[int]) -> dict[int, Expert]:
        """Bypassed experts: read from the file into scratch buffers when the store can (interleaved on the way
        when the cache interleaves), else where they live."""
        if self.store.reader is None and not self._relayout.get(layer):
            return {e: self.store.get(layer, e) for e in experts}
        like, out = self._like[layer], {}
        for e, buf in zip(experts, self._scratch_buffers(len(experts), self.store.expert_bytes(layer))):
            self._fill(layer, e, buf)
            out[e] = Expert.from_buffer(buf, like)
        return out

    def _fill(self, layer: int, e: int, dst: torch.Tensor) -> int:
        """Expert e's bytes into the host buffer dst (gate | up | down): read from the file or copied from where
        it lives, rewritten into the interleaved layout on the way for the parts that take it."""
        parts = self._relayout.get(layer)
        if not parts:
            return self.store.read_into(layer, e, dst)
        from moerun.kernels import cpu

        stage = self._staging.get(threading.get_ident())  # one per thread: the prefetch worker has its own
        if stage is None or stage.numel() < dst.numel():
            stage = self._staging[threading.get_ident()] = torch.empty(dst.numel(), dtype=torch.uint8)
        n = self.store.read_into(layer, e, stage[:dst.numel()])
        read = Expert.from_buffer(stage[:dst.numel()], self.store.get(layer, 0))
        off = 0
        for t, il in zip((read.gate, read.up, read.down), parts):
            if il:
                cpu.interleave_into(t, dst[off:off + t.nbytes])
            else:
                dst[off:off + t.nbytes].copy_(t.data.reshape(-1))
            off += t.nbytes
        return n

    def _load(self, layer: int, e: int, slot: int) -> int:
        """Expert e into a host slot: read from the file, or copied from where it lives."""
        return self._fill(layer, e, self.buffers[layer][slot])

    def prefetch(self, layer: int, guessed: Sequence[int]) -> None:
        """Page in a guess of ``layer``'s next step (most likely first) in the background; no-op when
        prefetch is off or the layer has no slots. ``fetch(layer)`` waits for it."""
        if self.prefetcher is not None and layer in self.tables:
            self.prefetcher.submit(layer, list(dict.fromkeys(int(e) for e in guessed)))

    def _prefetch_layer(self, layer: int, guessed: Sequence[int]) -> tuple[int, int]:
        """On the worker: reserve a slot for each guessed expert not resident (the guess pinned: it never
        evicts itself) and read the expert into it. -> (bytes read, evictions)."""
        table, pinned = self.tables[layer], set(guessed)
        paged = evictions = 0
        try:
            for e in guessed:
                with self._lock:
                    load = table.prefetch(e, pinned=pinned)
                if load is None:
                    continue
                evictions += load.evicted is not None
                paged += self._load(layer, e, load.slot)
        except BaseException:
            with self._lock:  # a slot may hold a partial read: forget the layer's residents, then report
                table.reset()
            raise
        return paged, evictions

    def fetch(self, layer: int, experts: list[int], phase: str) -> dict[int, Expert]:
        """expert id -> its weights for this step: a slot's views for hits and loads; for bypasses, scratch
        views (store with a reader) or views of where they live. (A device stage's cache uses `place`.)"""
        if self.transfers is not None:
            raise RuntimeError("fetch() is for caches whose slots are in host RAM; a device stage uses place()")
        table = self.tables.get(layer)
        t0 = time.perf_counter()
        self.usage.record(layer, experts)
        done = None if self.prefetcher is None else self.prefetcher.wait(layer)  # never compute on a slot being written
        if done is not None:
            self.stats.record_prefetch(layer, phase, done.guessed, set(experts))
            self.stats.add(layer, phase, bytes_paged_in=done.bytes_paged_in, evictions=done.evictions)
        waited = 0.0 if done is None else time.perf_counter() - t0
        if table is None:  # no slots for this layer: everything is computed at home
            out = self._home(layer, list(dict.fromkeys(experts)))
            self.stats.record_step(layer, phase, hits=0, misses=len(out), misses_home=len(out),
                                   seconds_stalled=time.perf_counter() - t0 if self.store.reader else waited)
            return out
        with self._lock:
            plan = table.request(experts, bypass_misses=phase == "prefill" and self.prefill == "bypass")
        try:
            paged = sum(self._load(layer, load.expert, load.slot) for load in plan.loads)
            home = self._home(layer, list(plan.bypassed))
        except BaseException:
            with self._lock:  # a slot may hold a partial read: forget the layer's residents, then report
                table.reset()
            raise
        read = plan.loads or (plan.bypassed and self.store.reader is not None)
        stalled = time.perf_counter() - t0 if read else waited
        self.stats.record_step(layer, phase, hits=len(plan.hits), misses=plan.misses, misses_home=len(plan.bypassed),
                               evictions=plan.evictions, bytes_paged_in=paged, seconds_stalled=stalled)
        with self._lock:
            slot_of = {e: table.slot_of(e) for e in (*plan.hits, *(ld.expert for ld in plan.loads))}
        return {e: self._slot(layer, s) for e, s in slot_of.items()} | home

    # -- device stages -----------------------------------------------------------------------------------
    def place(self, layer: int, need: dict[int, int], phase: str,
              choose: Callable[[int, int], str]) -> Placement:
        """A device stage's step at `layer`: need maps each distinct expert to its token count; choose(expert,
        tokens) -> "fetch" or "home" for a miss (the cost model, or a forced mode). Page-ins are queued on the
        copy stream here; `stream` runs the streamed ones; `computed` must follow the step's device compute."""
        if self.transfers is None:
            raise RuntimeError("place() is for caches whose slots are on a device stage")
        self.transfers.settle(self.stats)
        unwaited = self._unwaited.pop(layer, None)
        if unwaited is not None:  # a step failed between its page-ins and their wait (out of memory): its slots
            self.transfers.wait(unwaited, layer, phase)  # count as resident, so compute waits for them now
        table, out = self.tables.get(layer), Placement()
        self.usage.record(layer, need)
        fetch = {e for e, n in need.items() if (table is None or table.slot_of(e) is None) and choose(e, n) == "fetch"}
        misses = [e for e in need if table is None or table.slot_of(e) is None]
        home = [e for e in misses if e not in fetch]
        bypass = phase == "prefill" and self.prefill == "bypass"
        loads, evictions = [], 0
        if table is not None:
            plan = table.request(list(need), bypass_misses=bypass, admit=lambda e: e in fetch)
            out.on_device = {e: self._slot(layer, table.slot_of(e)) for e in plan.hits}
            loads, evictions = plan.loads, plan.evictions
            out.streamed = [e for e in plan.bypassed if e in fetch]
        else:
            out.streamed = sorted(fetch)
        paged = 0
        if loads:
            try:
                paged, out.ready = self.transfers.load(layer, [(ld.expert, self.buffers[layer][ld.slot])
                                                              for ld in loads], phase, after=self._used.get(layer))
            except BaseException:
                table.reset()  # a slot may hold a partial copy: forget the layer's residents, then report
                raise
            out.paged = {ld.expert: self._slot(layer, ld.slot) for ld in loads}
            self._unwaited[layer] = out.ready
        out.home = self._home(layer, home)
        self.stats.record_step(layer, phase, hits=len(out.on_device), misses=len(misses), evictions=evictions,
                               bytes_paged_in=paged, misses_home=len(home), misses_streamed=len(out.streamed))
        return out

    def wait_ready(self, placement: Placement, layer: int, phase: str) -> None:
        """Compute queued from now on reads the placement's page-ins only once they have landed."""
        if placement.ready is not None:
            self.transfers.wait(placement.ready, layer, phase)
            self._unwaited.pop(layer, None)

    def stream(self, layer: int, experts: list[int], phase: str) -> Iterator[dict[int, Expert]]:
        """The streamed experts of a placement, chunk by chunk through the stream buffer (views valid until the
        next chunk is asked for)."""
        for chunk, nbytes in self.streamer.run(layer, experts, phase):
            self.stats.add(layer, phase, bytes_streamed=nbytes)
            yield chunk

    def computed(self, layer: int) -> None:
        """The step's device compute at `layer` is queued: later copies into its slots wait for it."""
        if self.transfers is not None:
            self._used[layer] = self.transfers.mark()

    def settle(self, wait: bool = True) -> None:
        """Copy and stall times of a device stage into the statistics (after its events are done)."""
        if self.transfers is not None:
            self.transfers.settle(self.stats, wait=wait)
