"""The CPU stand-in for a GPU (`standin:N`), with CUDA's semantics where they bite (DESIGN decision 10).

Its memory is the host's and its kernels run at once on the host, but it is not forgiving:

- **Copies.** A copy queued on a side stream lands only when someone waits for it (an event waited on by
  the compute stream or synchronised, the stream synchronised); until then its destination reads as poison
  (0xFF bytes: NaN in every float type). `Event.query` completes pending copies at random (seeded jitter).
  A side-stream copy into memory the compute stream allocated must be ordered after that allocation (the
  copy stream waited on a compute event recorded after it): the block may have been freed by the compute
  stream a moment before, with its kernels still queued (`StandinError`).
- **Allocator.** `empty` hands a freed block out again at once, poisoned, unless it was recorded to a
  stream (`record_stream`) whose work queued before the free has not completed. A pending copy that lands
  in a block handed out again is a fault (`StandinError`).
- **Current device.** Memory is tagged with its device; a Triton launch whose tensors live on a stand-in
  device other than the current one (`use`) fails, and so does an event recorded on another device.
- **Counting.** Inside `counting()`, device-to-host reads are syncs (`.item()`, `int()` / `bool()` of a
  tensor, `.tolist()`, `.cpu()`, `.numpy()`, `nonzero`, `bincount`, `unique`, boolean-mask indexing, ...)
  and every torch op that would launch a kernel (through a dispatch mode) and every Triton launch is a
  launch. Tensors that `to_host` brought back are host memory: reading them is free. `on_host()` suspends
  counting for work a GPU path runs on the CPU.
- **Graphs.** `capture()` records the step's kernels (torch ops and Triton launches, with their arguments,
  as CUDA does: Python values are baked in) and fails on any sync; `Graph.replay` runs the recording again,
  writing into the same buffers.

The state of all stand-in devices of a thread lives in one `Simulator` (`active()`), per context.
"""

from __future__ import annotations

import bisect
import contextvars
import random
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moerun.errors import MoerunError

FREE_KEPT = 256 << 20  # freed blocks kept for reuse, bytes
POISON = 0xFF  # every byte of memory not yet written: NaN in float32, float16 and bfloat16

aten = torch.ops.aten
# ops whose output size depends on the data: the host waits for the device to learn it
DATA_DEPENDENT = {aten.nonzero.default, aten.bincount.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.masked_select.default}
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach_.default, aten.detach.default, aten.alias.default,
             aten.lift_fresh.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
             aten.is_same_size.default, aten.set_.source_Storage_storage_offset, aten.resize_.default,
             aten._reshape_alias.default}
SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}  # int(), bool(), .item()
HOST_READS = {"tolist", "cpu", "numpy"}  # Tensor methods that read device memory on the host


class StandinError(MoerunError):
    """What a real GPU would do wrong or fault on, caught by the stand-in."""


@dataclass
class Counts:
    """What a span of work did: syncs and launches by name, bytes over the link."""

    syncs: Counter = field(default_factory=Counter)
    launches: Counter = field(default_factory=Counter)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    graph_kernels: int = 0  # kernels run by replayed graphs (launches counts each replay once, as "graph")

    @property
    def kernels(self) -> int:
        """Kernels the device runs: those launched one by one and those inside replayed graphs."""
        return self.n_launches - self.launches["graph"] + self.graph_kernels

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def n_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def n_triton(self) -> int:
        return sum(n for k, n in self.launches.items() if k.startswith("triton:"))


class _Stream:
    """A stand-in stream: the compute stream runs work at once; a side stream queues copies until waited for."""

    def __init__(self, sim: Simulator, index: int, compute: bool):
        self.sim, self.index, self.compute = sim, index, compute
        self.clock = 0  # operations queued so far
        self.done = 0  # of which completed
        self.pending: list[tuple[int, object]] = []  # (clock, copy) not landed yet
        self.after: dict[int, int] = {}  # id(stream) -> that stream's clock this one is ordered after

    def tick(self) -> int:
        self.clock += 1
        if self.compute:
            self.done = self.clock
        return self.clock

    def flush(self, upto: int | None = None) -> None:
        upto = self.clock if upto is None else upto
        while self.pending and self.pending[0][0] <= upto:
            _, op = self.pending.pop(0)
            op()
        self.done = max(self.done, upto)


@dataclass
class _Block:
    base: torch.Tensor  # uint8, owned here
    index: int
    ref: StorageWeakRef | None = None  # the storage handed out
    generation: int = 0
    stream: _Stream | None = None  # allocated on (None: the compute stream)
    compute_clock: int = 0  # the compute stream's clock at allocation
    recorded: list[tuple[_Stream, int]] = field(default_factory=list)  # streams using it, up to their clock

    def free(self) -> bool:
        return self.ref is None or self.ref.expired()

    def reusable(self) -> bool:
        return self.free() and all(s.done >= c for s, c in self.recorded)


class Event:
    def __init__(self, sim: Simulator, index: int):
        self.sim, self.index = sim, index
        self.stream: _Stream | None = None
        self.at = 0

    def record(self, stream: _Stream | None) -> None:
        if self.sim.current != self.index and stream is None:
            raise StandinError(f"an event of standin:{self.index} recorded while standin:{self.sim.current} is "
                               "current: it would time the current device's stream")
        self.stream = stream or self.sim.compute(self.index)
        self.at = self.stream.tick()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.sim.sync("event.synchronize")
            self.stream.flush(self.at)

    def query(self) -> bool:
        if self.stream is None or self.stream.done >= self.at:
            return True
        if self.sim.rng.random() < self.sim.jitter:  # the copy engine got there by now, or not
            self.stream.flush(self.at)
        return self.stream.done >= self.at


class Graph:
    """A captured step: its kernels in order with their arguments and outputs (CUDA's graph semantics)."""

    def __init__(self):
        self.ops: list[tuple] = []

    @property
    def kernels(self) -> int:
        return len(self.ops)

    def replay(self, sim: Simulator) -> None:
        sim.count_launch("graph")
        if not sim._quiet:
            for c in sim._counts:
                c.graph_kernels += len(self.ops)
        with sim.suspended():
            for kind, fn, args, kwargs, out in self.ops:
                if kind == "triton":
                    fn[args](*kwargs[0], **kwargs[1])
                    continue
                res = fn(*args, **kwargs)
                if out is not None:
                    for o, r in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                        if isinstance(o, torch.Tensor) and o.data_ptr() != r.data_ptr():
                            o.copy_(r)


class Simulator:
    """Every stand-in device of this context: streams, memory, the current device, counters, captures."""

    def __init__(self, seed: int = 0):
        self.current = 0
        self.rng = random.Random(seed)
        self.jitter = 0.5  # the chance that a copy asked about has landed (0: only when waited for)
        self._compute: dict[int, _Stream] = {}
        self._blocks: list[_Block] = []
        self._tags: list[tuple[int, int, int, StorageWeakRef]] = []  # (start, end, device, storage), by start
        self._host: dict[int, StorageWeakRef] = {}  # storages to_host brought back, by data_ptr
        self._counts: list[Counts] = []
        self._graph: Graph | None = None
        self._quiet = 0
        self._modes = None
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self.real = False  # counting work on a real GPU: host memory is what is not on CUDA

    # -------------------------------------------------------------------------------- devices, streams

    @contextmanager
    def use(self, index: int):
        prev, self.current = self.current, index
        try:
            yield
        finally:
            self.current = prev

    def compute(self, index: int) -> _Stream:
        if index not in self._compute:
            self._compute[index] = _Stream(self, index, compute=True)
        return self._compute[index]

    def stream(self, index: int) -> _Stream:
        st = _Stream(self, index, compute=False)
        self._streams.add(st)
        return st

    def synchronize(self, index: int) -> None:
        """The host waits for all of standin:`index`'s work (every stream's copies land)."""
        self.sync("synchronize")
        for st in list(self._streams):
            if st.index == index:
                st.flush()

    def wait(self, stream: _Stream, event: Event) -> None:
        """`stream` runs what is queued on it from now on after `event`."""
        if event.stream is None:
            return
        if stream.compute:
            event.stream.flush(event.at)  # the compute stream goes on once the copies have landed
        stream.after[id(event.stream)] = max(stream.after.get(id(event.stream), 0), event.at)

    # ---------------------------------------------------------------------------------------- memory

    def tag(self, t: torch.Tensor, index: int) -> None:
        """Mark t's memory as standin:`index`'s (launches check it against the current device)."""
        if not t.numel():
            return
        st = t.untyped_storage()
        start = st.data_ptr()
        self._tags = [g for g in self._tags if not g[3].expired()]
        bisect.insort(self._tags, (start, start + st.nbytes(), index, StorageWeakRef(st)), key=lambda g: g[0])

    def device_of(self, t: torch.Tensor) -> int | None:
        p = t.data_ptr()
        i = bisect.bisect_right(self._tags, p, key=lambda g: g[0]) - 1
        while i >= 0:
            start, end, index, ref = self._tags[i]
            if start <= p < end and not ref.expired():
                return index
            if end <= p and i < len(self._tags) - 1:
                break
            i -= 1
        return None

    def empty(self, index: int, nbytes: int, stream: _Stream | None = None) -> torch.Tensor:
        """nbytes of device memory allocated on `stream` (the compute stream by default): a freed block handed out
        again at once where one fits, poisoned either way."""
        with self.suspended(), torch.inference_mode(False):  # device memory outlives any inference-mode step
            return self._empty(index, nbytes, stream)

    def _empty(self, index: int, nbytes: int, stream: _Stream | None) -> torch.Tensor:
        self._prune()
        fits = [b for b in self._blocks if b.index == index and b.base.numel() >= nbytes and b.reusable()]
        if fits:
            blk = min(fits, key=lambda b: b.base.numel())
            blk.generation += 1
            blk.recorded = []
        else:
            blk = _Block(torch.empty(max(nbytes, 1), dtype=torch.uint8), index)
            self._blocks.append(blk)
        blk.base.fill_(POISON)
        blk.stream, blk.compute_clock = stream, self.compute(index).clock
        out = torch.frombuffer(memoryview(blk.base.numpy()[:nbytes]), dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        blk.ref = StorageWeakRef(out.untyped_storage()) if nbytes else None
        self.tag(out, index)
        return out

    def _prune(self) -> None:
        """Give back free blocks beyond FREE_KEPT bytes, oldest first (the pool would otherwise hold every block
        ever allocated)."""
        free = [b for b in self._blocks if b.reusable()]
        extra = sum(b.base.numel() for b in free) - FREE_KEPT
        for b in free:
            if extra <= 0:
                break
            self._blocks.remove(b)
            extra -= b.base.numel()

    def _block(self, t: torch.Tensor) -> tuple[_Block, int] | None:
        p = t.data_ptr()
        for b in self._blocks:
            if b.base.data_ptr() <= p < b.base.data_ptr() + b.base.numel() and not b.free():
                return b, p - b.base.data_ptr()
        return None

    def record_stream(self, t: torch.Tensor, stream: _Stream) -> None:
        found = self._block(t)
        if found is not None:
            found[0].recorded.append((stream, stream.clock))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: _Stream | None) -> None:
        """dst <- src on `stream` (at once on the compute stream; queued, dst poisoned, on a side stream)."""
        self.count_bytes(dst, src)
        if stream is None or stream.compute:
            with self.suspended():
                dst.copy_(src)
            return
        found = self._block(dst)
        if found is not None:
            blk, off = found
            compute = self.compute(blk.index)
            if blk.stream is not stream and stream.after.get(id(compute), 0) < blk.compute_clock:
                raise StandinError("a copy stream writes into memory the compute stream allocated without waiting "
                                   "for it: on a GPU the block's previous owner may still be read by queued kernels")
            gen, n = blk.generation, dst.numel() * dst.element_size()

            def land(blk=blk, gen=gen, off=off, n=n, shape=dst.shape, dtype=dst.dtype, src=src):
                if blk.generation != gen:
                    raise StandinError("a copy landed in device memory that was freed and handed out again "
                                       "(record the buffer to the copy stream, or wait before freeing it)")
                with self.suspended():
                    blk.base[off:off + n].view(dtype).view(shape).copy_(src)
        else:
            def land(dst=dst, src=src):
                with self.suspended():
                    dst.copy_(src)
        with self.suspended():
            _poison(dst)
        stream.pending.append((stream.tick(), land))

    def count_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for c in self._counts:
            c.h2d_bytes += src.numel() * src.element_size()

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device tensors read back by the host: one sync, copies marked as host memory."""
        self.sync("to_host")
        with self.suspended():
            out = [t.clone() for t in tensors]
        for t in out:
            for c in self._counts:
                c.d2h_bytes += t.numel() * t.element_size()
            if t.numel():
                self._host[t.untyped_storage().data_ptr()] = StorageWeakRef(t.untyped_storage())
        self._host = {p: r for p, r in self._host.items() if not r.expired()}
        return out

    def upload(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """A host tensor copied to standin:`index` (a copy kernel: counted, and recorded in a capture)."""
        for c in self._counts:
            c.h2d_bytes += t.numel() * t.element_size()
        out = t.clone()
        self.tag(out, index)
        return out

    def is_host(self, t: torch.Tensor) -> bool:
        if not isinstance(t, torch.Tensor) or not t.numel():
            return True
        if self.real:
            return not t.is_cuda
        r = self._host.get(t.untyped_storage().data_ptr())
        return r is not None and not r.expired()

    # ------------------------------------------------------------------------------ counting, graphs

    def sync(self, what: str) -> None:
        if self._quiet:
            return
        if self._graph is not None:
            raise StandinError(f"{what}: the host waits for the device while a CUDA graph is captured")
        for c in self._counts:
            c.syncs[what] += 1

    def count_launch(self, what: str) -> None:
        if not self._quiet:
            for c in self._counts:
                c.launches[what] += 1

    def launch(self, kernel, grid, args, kwargs):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.numel():
                dev = self.device_of(a)
                if dev is not None and dev != self.current:
                    raise StandinError(f"a kernel launched on standin:{self.current} reads memory of standin:{dev} "
                                       "(an illegal address on a GPU): enter device.use(dev) first")
        fn = getattr(kernel, "fn", kernel)
        self.count_launch(f"triton:{getattr(fn, '__name__', 'kernel')}")
        if self._graph is not None and not self._quiet:
            self._graph.ops.append(("triton", kernel, grid, (args, kwargs), None))
        with self.suspended():
            return kernel[grid](*args, **kwargs)

    @contextmanager
    def suspended(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    @contextmanager
    def _watching(self):
        if self._modes is not None:
            yield
            return
        self._modes = (_Functions(self), _Dispatch(self))
        try:
            with self._modes[0], self._modes[1], self._interpreted_launches():
                yield
        finally:
            self._modes = None

    @contextmanager
    def _interpreted_launches(self):
        """Triton kernels launched other than through `launch` (triton's interpreter runs them here): counted as one
        launch each, the interpreter's own copies of their arguments not counted."""
        try:
            from triton.runtime.interpreter import GridExecutor
        except ImportError:
            yield
            return
        call = GridExecutor.__call__
        sim = self

        def counted(executor, *args, **kwargs):
            sim.count_launch(f"triton:{getattr(executor.fn, '__name__', 'kernel')}")
            with sim.suspended():
                return call(executor, *args, **kwargs)

        GridExecutor.__call__ = counted
        try:
            yield
        finally:
            GridExecutor.__call__ = call

    @contextmanager
    def counting(self, real: bool = False):
        """Counts of the work done inside (real: of a real GPU's tensors)."""
        c = Counts()
        self.real = real
        self._counts.append(c)
        try:
            with self._watching():
                yield c
        finally:
            self._counts.remove(c)

    @contextmanager
    def capture(self, graph: Graph):
        if self._graph is not None:
            raise StandinError("a capture inside a capture")
        self._graph = graph
        try:
            with self._watching():
                yield graph
        finally:
            self._graph = None

    def record(self, func, args, kwargs, out) -> None:
        if self._graph is not None and not self._quiet:
            self._graph.ops.append(("torch", func, args, kwargs, None if func._schema.is_mutable else out))


class _Functions(TorchFunctionMode):
    def __init__(self, sim: Simulator):
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and args and isinstance(args[0], torch.Tensor) and not self.sim.is_host(args[0]):
            self.sim.sync(name)
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __init__(self, sim: Simulator):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sim = self.sim
        if sim._quiet or func in NO_KERNEL or func.is_view:
            return out
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if tensors and all(sim.is_host(t) for t in tensors):
            return out
        if func in SCALAR_READS:
            sim.sync("item")
            return out
        if func in DATA_DEPENDENT or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None) \
                or (func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                     for i in tree_flatten(args[1:])[0])):
            sim.sync(func.overloadpacket.__name__)
        sim.count_launch(func.overloadpacket.__name__)
        sim.record(func, args, kwargs, out)
        return out


def _poison(t: torch.Tensor) -> None:
    if t.is_contiguous():
        t.view(-1).view(torch.uint8).fill_(POISON)
    else:
        t.fill_(float("nan") if t.is_floating_point() else -1)


_active: contextvars.ContextVar[Simulator | None] = contextvars.ContextVar("moerun_standin", default=None)


def active() -> Simulator:
    """This context's simulator (made at first use)."""
    sim = _active.get()
    if sim is None:
        sim = Simulator()
        _active.set(sim)
    return sim


def current() -> Simulator | None:
    """The simulator if stand-in devices have been used in this context (else None: nothing to check)."""
    return _active.get()


@contextmanager
def fresh(seed: int = 0):
    """A new simulator for the duration (tests)."""
    token = _active.set(Simulator(seed))
    try:
        yield _active.get()
    finally:
        _active.reset(token)
