"""Compute devices, and the only module that calls CUDA (DESIGN decision 12).

Three kinds of device:

- ``cpu``: the host itself; nothing is copied anywhere.
- ``cuda:N``: a GPU. Dense weights, KV and expert slots live in its memory; expert pages come in from
  pinned host memory on a copy stream, ordered against compute by events.
- ``standin:N``: the CPU standing in for a GPU. It has a device tier of its own, so every code path a GPU
  runs (placement, VRAM accounting, slots, page-ins, streams, events, the miss path) runs on it too; its
  memory is ordinary memory, its copies are synchronous, its events are wall-clock stamps and its kernels
  the host's. CI checks the GPU path's logic through it; a GPU run then checks speed.

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
    from moerun.placement.devices import parse_size

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


def release_memory() -> None:
    """Give the GPUs' cached, unused memory back (after an out-of-memory step)."""
    if cuda_available():
        import torch

        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, DeviceOutOfMemory))


# ------------------------------------------------------------------------------------------ buffers


def empty(dev: Device, nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of `nbytes` in the device's memory."""
    import torch

    from moerun.hostmem import host_empty

    if dev.kind == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=dev.torch)
    return host_empty(nbytes)


def to_device(t: torch.Tensor, dev: Device) -> torch.Tensor:
    """A copy of `t` in the device's memory (the tensor itself where that is where it already lives)."""
    if dev.kind == "cuda":
        return t.to(dev.torch)
    if dev.kind == "standin" and t.is_cpu:
        return t  # the stand-in's memory is the host's: placing a tensor there moves nothing
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
            if self.pinned:
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
    """A CUDA stream, or the stand-in's: work "on" it runs at once, in order."""

    def __init__(self, dev: Device, current: bool = False):
        import torch

        self.dev = dev
        self._s = None
        if dev.kind == "cuda":
            self._s = torch.cuda.current_stream(dev.index) if current else torch.cuda.Stream(dev.torch)

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

    def synchronize(self) -> None:
        if self._s is not None:
            self._s.synchronize()


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
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> Event:
        if self._e is not None:
            self._e.record(stream._s if stream is not None else None)
        else:
            self._t = time.perf_counter()
        return self

    def synchronize(self) -> None:
        """Block the host until the event's work is done."""
        if self._e is not None:
            self._e.synchronize()

    def query(self) -> bool:
        return self._e.query() if self._e is not None else True

    def seconds_to(self, end: Event) -> float:
        """Seconds from this event to `end` (both recorded with timing, `end` done)."""
        if self._e is not None:
            return self._e.elapsed_time(end._e) / 1e3
        return max(0.0, (end._t or 0.0) - (self._t or 0.0))


def copy_(dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> None:
    """dst <- src, asynchronous on `stream` for host-to-device copies from pinned memory (a pageable source is
    refused: it would copy synchronously and stall both streams). The stand-in copies at once."""
    if dst.is_cuda or src.is_cuda:
        if src.is_cpu and not src.is_pinned():
            raise DeviceError("host-to-device copy from pageable memory; stage it in pinned memory first")
        with stream if stream is not None else nullcontext():
            dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(src)


def upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on the torch device `dev`, copied without waiting for the device: through pinned memory
    (`t` itself when it is pinned), asynchronously on the current stream. The tensor itself off CUDA."""
    if dev.type != "cuda":
        return t.to(dev)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def to_host(tensors: list[torch.Tensor], out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Device tensors back to the host with one synchronisation (pinned destinations, async copies, one wait);
    CPU tensors come back as they are."""
    import torch

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
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev.torch)
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times = sorted(times[1:])  # the first copy warms the path up
    return nbytes / times[len(times) // 2] / 1e9
