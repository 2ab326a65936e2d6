"""Compute devices, and the only module that calls CUDA (DESIGN decision 12).

Three kinds of device:

- ``cpu``: the host itself; nothing is copied anywhere.
- ``cuda:N``: a GPU. Dense weights, KV and expert slots live in its memory; expert pages come in from
  pinned host memory on a copy stream, ordered against compute by events.
- ``standin:N``: the CPU standing in for a GPU. It has a device tier of its own, so every code path a GPU
  runs (placement, VRAM accounting, slots, page-ins, streams, events, the miss path) runs on it too. Its
  memory is host memory and its kernels the host's, but its streams, copies, allocator, current device and
  graphs keep CUDA's rules, adversarially (moerun.standin: late copies read as poison, freed blocks are
  handed out again at once, a launch off the current device fails, syncs and launches are counted). CI
  checks the GPU path's logic and its work per token through it; a GPU run then checks speed.

Everything device-specific the rest of moerun needs is here: names, memory queries, buffers (device,
pinned host), copies, streams, events, synchronisation, out-of-memory errors.
"""

from __future__ import annotations

import os
import re
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moerun.errors import MoerunError
from moerun.sizes import parse_size

if TYPE_CHECKING:
    import torch

KINDS = ("cpu", "cuda", "standin")
STANDIN_VRAM_ENV = "MOERUN_STANDIN_VRAM"  # the stand-in's memory size (bytes or e.g. "8GiB"); default 8 GiB
STANDIN_VRAM_DEFAULT = 8 << 30


class DeviceError(MoerunError):
    """A device that is not there, or cannot do what was asked (one line for the user)."""


class DeviceOutOfMemory(MoerunError):
    """A device ran out of memory during a step (the step's requests fail; the process goes on)."""


@dataclass(frozen=True)
class Device:
    kind: str
    index: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown device kind {self.kind!r}; one of {KINDS}")

    @property
    def name(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    def __str__(self) -> str:
        return self.name

    @property
    def torch(self) -> torch.device:
        """Where its tensors live: the GPU, or host memory for the CPU and its stand-in."""
        import torch

        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")

    @property
    def accelerator(self) -> bool:
        """A device tier apart from host RAM (a GPU or its stand-in): weights are placed on it, experts paged."""
        return self.kind != "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


CPU = Device("cpu")
_NAME = re.compile(r"(cuda|standin):?(\d+)")


def canonical(name: str) -> str:
    """llama.cpp's CPU / CUDA0 or cpu / cuda:0 / cuda0 / standin:0 -> 'cpu' / 'cuda:0' / 'standin:0'."""
    s = str(name).strip().lower()
    if s == "cpu":
        return s
    m = _NAME.fullmatch(s)
    if not m:
        raise ValueError(f"unknown device {name!r} (use CPU, CUDA0, CUDA1, ... or cpu, cuda:0, standin:0)")
    return f"{m[1]}:{int(m[2])}"


def parse(name: str | Device) -> Device:
    if isinstance(name, Device):
        return name
    s = canonical(name)
    if s == "cpu":
        return CPU
    kind, index = s.split(":")
    return Device(kind, int(index))


# ------------------------------------------------------------------------------------------- CUDA


def set_pci_order() -> None:
    """Number GPUs in PCI bus order, as nvidia-smi and llama.cpp's --gpus do (before CUDA starts)."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def cuda_available() -> bool:
    import torch

    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver is "no CUDA"
        return False


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if cuda_available() else 0


@dataclass(frozen=True)
class CudaInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    mem_bus_bits: int | None
    mem_clock_mhz: int | None


def cuda_devices() -> list[CudaInfo]:
    """Every CUDA device torch sees (no PCIe figures: NVML has those); [] without CUDA."""
    import torch

    out = []
    for i in range(cuda_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        clock_khz = getattr(p, "memory_clock_rate", None)
        out.append(CudaInfo(i, p.name, int(total), int(free), getattr(p, "memory_bus_width", None),
                            int(clock_khz) // 1000 if clock_khz else None))
    return out


def describe(dev: Device) -> str:
    """The device's model name ("NVIDIA H200"), "CPU stand-in", or "" for the CPU."""
    if dev.kind == "cuda":
        import torch

        return torch.cuda.get_device_name(dev.index)
    return "CPU stand-in" if dev.kind == "standin" else ""


def check(dev: Device) -> None:
    """That `dev` can be used here; DeviceError (one line) if not."""
    if dev.kind != "cuda":
        return
    n = cuda_count()
    if n == 0:
        raise DeviceError(f"{dev}: no CUDA device is available here; run on the CPU with --device cpu")
    if dev.index >= n:
        raise DeviceError(f"{dev}: there are only {n} CUDA device(s) here (cuda:0..cuda:{n - 1})")


def standin_vram() -> int:
    raw = os.environ.get(STANDIN_VRAM_ENV)
    if not raw:
        return STANDIN_VRAM_DEFAULT
    try:
        return parse_size(raw)
    except ValueError as e:
        raise DeviceError(f"{STANDIN_VRAM_ENV}={raw}: {e}") from None


def memory(dev: Device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory: what CUDA reports; the stand-in's configured size
    (MOERUN_STANDIN_VRAM); the host's available and total RAM for the CPU."""
    import torch

    if dev.kind == "cuda":
        check(dev)
        free, total = torch.cuda.mem_get_info(dev.index)
        return int(free), int(total)
    if dev.kind == "standin":
        size = standin_vram()
        return size, size
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def synchronize(dev: Device) -> None:
    import torch

    if dev.kind == "cuda":
        torch.cuda.synchronize(dev.index)
    elif dev.kind == "standin":
        from moerun import standin

        standin.active().synchronize(dev.index)


def release_memory() -> None:
    """Give the GPUs' cached, unused memory back (after an out-of-memory step)."""
    if cuda_available():
        import torch

        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, DeviceOutOfMemory))


# ------------------------------------------------------------------------------------------ buffers


def empty(dev: Device, nbytes: int, stream: Stream | None = None) -> torch.Tensor:
    """An uninitialised uint8 buffer of `nbytes` in the device's memory, from `stream`'s pool (default: the
    compute stream's). Work on another stream may use it only after waiting for an event that `stream`
    recorded after this allocation (and `record_stream` it, where that stream may still use it when it goes)."""
    import torch

    from moerun.hostmem import host_empty

    if dev.kind == "cuda":
        with torch.cuda.stream(stream._s) if stream is not None else nullcontext():
            return torch.empty(nbytes, dtype=torch.uint8, device=dev.torch)
    if dev.kind == "standin":
        from moerun import standin

        return standin.active().empty(dev.index, nbytes, stream._ss if stream is not None else None)
    return host_empty(nbytes)


def record_stream(t: torch.Tensor, stream: Stream) -> None:
    """`t`'s memory is used by work on `stream`: when `t` goes, it is not handed out again before that work is done."""
    if stream._s is not None and t.is_cuda:
        t.record_stream(stream._s)
    elif stream._ss is not None:
        stream._ss.sim.record_stream(t, stream._ss)


def to_device(t: torch.Tensor, dev: Device) -> torch.Tensor:
    """A copy of `t` in the device's memory (the tensor itself where that is where it already lives)."""
    if dev.kind == "cuda":
        return t.to(dev.torch)
    if dev.kind == "standin" and t.is_cpu:
        from moerun import standin

        standin.active().tag(t, dev.index)
        return t  # the stand-in's memory is the host's: placing a tensor there moves nothing (it is tagged as its)
    return t.cpu()


class PinnedRegion:
    """Host memory registered with the driver for DMA (cudaHostRegister), in place: no copy, no power-of-two
    rounding (torch's pinned allocator rounds up). Unregistered when this object goes: its owner keeps it as
    long as the memory is copied from."""

    def __init__(self, t: torch.Tensor, dev: Device):
        import torch

        self.tensor, self.pinned = t, dev.kind != "cuda"  # the stand-in and the CPU need no registration
        if dev.kind == "cuda" and t.numel():
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            self.pinned = int(rc) == 0
            if not self.pinned:
                cudart.cudaGetLastError()  # clear the sticky error, or the next kernel launch reports it
            else:
                self._done = weakref.finalize(self, cudart.cudaHostUnregister, t.data_ptr())


def pin(t: torch.Tensor, dev: Device) -> PinnedRegion:
    """Page-lock a contiguous host tensor for async copies to `dev`; `.pinned` says whether it worked."""
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("pin needs a contiguous host tensor")
    return PinnedRegion(t, dev)


def pinned_empty(nbytes: int, dev: Device) -> torch.Tensor:
    """A page-locked host buffer (staging for copies to and from `dev`); an ordinary one off CUDA."""
    import torch

    if dev.kind == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8)


# ---------------------------------------------------------------------------------- streams, events


class Stream:
    """A CUDA stream, or the stand-in's (moerun.standin: the compute stream runs work at once, a side stream's copies
    land when waited for)."""

    def __init__(self, dev: Device, current: bool = False):
        import torch

        self.dev = dev
        self._s = self._ss = None
        if dev.kind == "cuda":
            self._s = torch.cuda.current_stream(dev.index) if current else torch.cuda.Stream(dev.torch)
        elif dev.kind == "standin":
            from moerun import standin

            sim = standin.active()
            self._ss = sim.compute(dev.index) if current else sim.stream(dev.index)

    def __enter__(self):
        import torch

        self._ctx = torch.cuda.stream(self._s) if self._s is not None else nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def wait(self, event: Event) -> None:
        """Work queued on this stream from now on starts after `event`."""
        if self._s is not None and event._e is not None:
            self._s.wait_event(event._e)
        elif self._ss is not None and event._se is not None:
            self._ss.sim.wait(self._ss, event._se)

    def synchronize(self) -> None:
        if self._s is not None:
            self._s.synchronize()
        elif self._ss is not None:
            self._ss.sim.sync("stream.synchronize")
            self._ss.flush()


def compute_stream(dev: Device) -> Stream:
    """The stream kernels are launched on (CUDA's current stream)."""
    return Stream(dev, current=True)


class Event:
    """A point in a stream's work. With timing, two recorded events give the seconds between them: CUDA's
    event timer on a GPU, the wall clock at record time on the stand-in (whose work is synchronous)."""

    def __init__(self, dev: Device, timing: bool = False):
        import torch

        self.dev, self.timing = dev, timing
        self._e = torch.cuda.Event(enable_timing=timing) if dev.kind == "cuda" else None
        self._se = None
        if dev.kind == "standin":
            from moerun import standin

            self._se = standin.Event(standin.active(), dev.index)
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> Event:
        if self._e is not None:
            self._e.record(stream._s if stream is not None else None)
        else:
            if self._se is not None:
                self._se.record(stream._ss if stream is not None else None)
            self._t = time.perf_counter()
        return self

    def synchronize(self) -> None:
        """Block the host until the event's work is done."""
        if self._e is not None:
            self._e.synchronize()
        elif self._se is not None:
            self._se.synchronize()

    def query(self) -> bool:
        if self._e is not None:
            return self._e.query()
        return self._se.query() if self._se is not None else True

    def seconds_to(self, end: Event) -> float:
        """Seconds from this event to `end` (both recorded with timing, `end` done)."""
        if self._e is not None:
            return self._e.elapsed_time(end._e) / 1e3
        return max(0.0, (end._t or 0.0) - (self._t or 0.0))


def copy_(dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> None:
    """dst <- src, asynchronous on `stream` for host-to-device copies from pinned memory (a pageable source is
    refused: it would copy synchronously and stall both streams). The stand-in's side-stream copies land when
    waited for (moerun.standin)."""
    if stream is not None and stream._ss is not None:
        stream._ss.sim.copy(dst, src, stream._ss)
    elif dst.is_cuda or src.is_cuda:
        if src.is_cpu and not src.is_pinned():
            raise DeviceError("host-to-device copy from pageable memory; stage it in pinned memory first")
        with stream if stream is not None else nullcontext():
            dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(src)


def upload(t: torch.Tensor, dev: torch.device | Device) -> torch.Tensor:
    """A host tensor on the device `dev`, copied without waiting for the device: through pinned memory (`t`
    itself when it is pinned), asynchronously on the current stream. Off CUDA the tensor itself (on the
    stand-in, a copy counted as one)."""
    if isinstance(dev, Device):
        if dev.kind == "standin":
            from moerun import standin

            return standin.active().upload(t, dev.index)
        dev = dev.torch
    if dev.type != "cuda":
        return t.to(dev)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def move(x: torch.Tensor, dev: Device) -> torch.Tensor:
    """The hidden state handed from one stage to the next on `dev`: a peer copy between GPUs (asynchronous, in the
    current stream's order), a counted copy between stand-in devices, nothing where it is already there."""
    if dev.kind == "cuda":
        return x if x.device == dev.torch else x.to(dev.torch, non_blocking=True)
    if dev.kind == "standin":
        from moerun import standin

        return standin.active().upload(x, dev.index)
    return x.cpu()


def to_host(tensors: list[torch.Tensor], out: list[torch.Tensor] | None = None,
            dev: Device | None = None) -> list[torch.Tensor]:
    """Device tensors back to the host with one synchronisation (pinned destinations, async copies, one wait);
    CPU tensors come back as they are (the stand-in's `dev`: copies, counted as one sync)."""
    import torch

    if dev is not None and dev.kind == "standin":
        from moerun import standin

        return standin.active().to_host(list(tensors))
    if not any(t.is_cuda for t in tensors):
        return list(tensors)
    res = []
    for i, t in enumerate(tensors):
        if not t.is_cuda:
            res.append(t)
            continue
        buf = out[i] if out is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        res.append(buf)
    torch.cuda.current_stream(next(t.device for t in tensors if t.is_cuda)).synchronize()
    return res


def measure_h2d_gbps(dev: Device, nbytes: int = 64 << 20, reps: int = 5) -> float | None:
    """Host-to-device copy bandwidth from pinned memory (the median of `reps` timed copies), GB/s; None off
    CUDA (the stand-in's copies are memcpy, no link to measure)."""
    import torch

    if dev.kind != "cuda":
        return None
    times = []
    with use(dev):  # the events time this device's stream, not cuda:0's
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev.torch)
        stream = torch.cuda.current_stream(dev.index)
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            dst.copy_(src, non_blocking=True)
            b.record(stream)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    times = sorted(times[1:])  # the first copy warms the path up
    return nbytes / times[len(times) // 2] / 1e9


# ------------------------------------------------------------------------- current device, launches


def use(dev: Device):
    """The context in which `dev` is the current device: kernels launched inside run there (CUDA's current device;
    the stand-in's, whose launches check it). The only place that sets it."""
    import torch

    if dev.kind == "cuda":
        return torch.cuda.device(dev.index)
    if dev.kind == "standin":
        from moerun import standin

        return standin.active().use(dev.index)
    return nullcontext()


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs): the one way moerun launches a Triton kernel. The launch must be on the device
    its tensors live on (the current one: `use`); it is counted (`counting`) and, inside a capture, recorded."""
    from moerun import standin

    sim = standin.current()
    if sim is not None:
        return sim.launch(kernel, grid, args, kwargs)
    dev = next((a.device for a in args if hasattr(a, "is_cuda") and a.is_cuda), None)
    if dev is not None:
        import torch

        if torch.cuda.current_device() != dev.index:
            raise DeviceError(f"a kernel on {dev} launched while cuda:{torch.cuda.current_device()} is current "
                              "(enter device.use(dev) first)")
    return kernel[grid](*args, **kwargs)


def counting(dev: Device):
    """A context whose value (moerun.standin.Counts) counts the syncs, launches and bytes of the work inside: torch's
    ops through a dispatch mode, Triton launches, copies; on the stand-in and on a GPU alike."""
    from moerun import standin

    return standin.active().counting(real=dev.kind == "cuda")


def on_host(dev: Device):
    """Work a device stage does on the CPU (home misses): not the device's syncs or launches."""
    if dev.kind == "standin":
        from moerun import standin

        return standin.active().suspended()
    return nullcontext()


class Graph:
    """A captured step (a CUDA graph; the stand-in's recording, with CUDA's rules: no sync inside, Python values
    baked in). `capture()` runs the step once while recording it; `replay()` runs the recording again, reading and
    writing the same buffers."""

    def __init__(self, dev: Device):
        import torch

        self.dev = dev
        self._g = torch.cuda.CUDAGraph() if dev.kind == "cuda" else None
        self._sg = None
        self.kernels: int | None = None  # kernels in the graph, where known (the stand-in's)

    def capture(self):
        import torch

        if self._g is not None:
            return torch.cuda.graph(self._g)
        if self.dev.kind != "standin":
            raise DeviceError(f"{self.dev}: graphs are for a GPU or its stand-in")
        from moerun import standin

        self._sg = standin.Graph()
        return _Captured(self)

    def replay(self) -> None:
        if self._g is not None:
            self._g.replay()
        else:
            from moerun import standin

            self._sg.replay(standin.active())


class _Captured:
    def __init__(self, g: Graph):
        self.g = g

    def __enter__(self):
        from moerun import standin

        self._ctx = standin.active().capture(self.g._sg)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        out = self._ctx.__exit__(*exc)
        self.g.kernels = self.g._sg.kernels
        return out
