"""What the machine offers: host RAM, physical cores, CPU features, GPUs (pynvml, else torch.cuda, else none).

`detect()` never fails for want of NVIDIA libraries: pynvml is an optional import, and every probe that
raises is treated as "not available". The dataclasses are frozen; the planner takes an `Inventory` and
tests build made-up ones by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moerun.sizes import format_size, parse_size  # noqa: F401 (re-exported: the CLI and the planner read them here)

# GB/s per lane and direction, after line coding (PCIe 1.0 .. 6.0)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# CPU features the kernels care about, as /proc/cpuinfo spells them (x86 "flags", ARM "Features")
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "neon", "asimddp", "i8mm",
                "sve", "sve2", "bf16")

@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    pcie_gen: int | None = None  # the MAX link generation (the current one drops at idle)
    pcie_width: int | None = None  # max lanes
    mem_bus_bits: int | None = None
    mem_clock_mhz: int | None = None  # max memory clock as NVML reports it (data rate = 2x)
    source: str = "manual"  # "nvml", "torch", "standin" or "manual"
    kind: str = "cuda"  # "cuda", or "standin" for the CPU standing in for a GPU (moerun.device)

    @property
    def device(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def mem_bandwidth_gbps(self) -> float | None:
        """Peak device-memory bandwidth estimate: bus bytes x clock x 2 (double data rate)."""
        if not self.mem_bus_bits or not self.mem_clock_mhz:
            return None
        return self.mem_bus_bits / 8 * self.mem_clock_mhz * 1e6 * 2 / 1e9

    @property
    def pcie_gbps(self) -> float | None:
        """Peak host-to-device bandwidth of the link, one direction."""
        if not self.pcie_gen or not self.pcie_width:
            return None
        return PCIE_LANE_GBPS.get(self.pcie_gen, PCIE_LANE_GBPS[6]) * self.pcie_width


@dataclass(frozen=True)
class Inventory:
    ram_total: int
    ram_available: int
    physical_cores: int
    logical_cores: int = 0
    cpu_features: tuple[str, ...] = ()
    gpus: tuple[GPU, ...] = ()

    def gpu(self, device: str) -> GPU:
        """The GPU named 'cuda:N' (or 'standin:N'); KeyError when there is none."""
        for g in self.gpus:
            if g.device == device:
                return g
        raise KeyError(f"no GPU {device} (found: {', '.join(g.device for g in self.gpus) or 'none'})")

    def to_json(self) -> dict:
        return {"ram_total": self.ram_total, "ram_available": self.ram_available,
                "physical_cores": self.physical_cores, "logical_cores": self.logical_cores,
                "cpu_features": list(self.cpu_features),
                "gpus": [{**g.__dict__, "mem_bandwidth_gbps": g.mem_bandwidth_gbps, "pcie_gbps": g.pcie_gbps}
                         for g in self.gpus]}


def parse_cpu_features(cpuinfo: str) -> tuple[str, ...]:
    """The CPU_FEATURES present in /proc/cpuinfo text (ARM's 'asimd' is reported as 'neon')."""
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            found.update(value.split())
    if "asimd" in found:
        found.add("neon")
    return tuple(f for f in CPU_FEATURES if f in found)


def _nvml_gpus() -> tuple[GPU, ...] | None:
    """GPUs as NVML sees them; None when pynvml or the driver library is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)

            def probe(fn, *args, _h=h):
                try:
                    return int(fn(_h, *args))
                except Exception:  # noqa: BLE001 - not supported on this board / driver
                    return None

            gpus.append(GPU(
                index=i, name=name.decode() if isinstance(name, bytes) else str(name),
                total_bytes=int(mem.total), free_bytes=int(mem.free),
                pcie_gen=probe(pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                pcie_width=probe(pynvml.nvmlDeviceGetMaxPcieLinkWidth),
                mem_bus_bits=probe(getattr(pynvml, "nvmlDeviceGetMemoryBusWidth", lambda _h: None)),
                mem_clock_mhz=probe(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_MEM),
                source="nvml"))
        return tuple(gpus)
    except Exception:  # noqa: BLE001 - a broken driver means "no NVML", never a crash
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - shutting down a library that already failed
            pass


def _gpu_driver_present() -> bool:
    """An NVIDIA (or ROCm) kernel driver is loaded; without one torch sees no GPU, so it need not be imported."""
    return any(Path(p).exists() for p in ("/proc/driver/nvidia/version", "/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd"))


def _torch_gpus() -> tuple[GPU, ...]:
    """GPUs as torch.cuda sees them (no PCIe figures); () without CUDA."""
    if not _gpu_driver_present():
        return ()
    try:
        from moerun import device

        return tuple(GPU(index=g.index, name=g.name, total_bytes=g.total_bytes, free_bytes=g.free_bytes,
                         mem_bus_bits=g.mem_bus_bits, mem_clock_mhz=g.mem_clock_mhz, source="torch")
                     for g in device.cuda_devices())
    except Exception:  # noqa: BLE001 - CUDA present but unusable: no GPUs
        return ()


def standin_gpu(index: int) -> GPU:
    """The CPU standing in for a GPU (moerun.device): its memory as the device module reports it."""
    from moerun import device

    free, total = device.memory(device.Device("standin", index))
    return GPU(index=index, name="CPU stand-in", total_bytes=total, free_bytes=free, source="standin",
               kind="standin")


def with_devices(inv: Inventory, names: tuple[str, ...]) -> Inventory:
    """`inv` with a stand-in GPU for every standin:N among `names` and the free memory of each CUDA device named
    taken from the device module now (NVML's figure was read before this process used the GPU)."""
    from dataclasses import replace

    from moerun import device

    gpus = {g.device: g for g in inv.gpus}
    for name in dict.fromkeys(names):
        dev = device.parse(name)
        if dev.kind == "standin":
            gpus[name] = standin_gpu(dev.index)
        elif dev.kind == "cuda" and name in gpus:
            free, _ = device.memory(dev)
            gpus[name] = replace(gpus[name], free_bytes=free)
    return replace(inv, gpus=tuple(gpus.values()))


def detect(cpuinfo: str | Path = "/proc/cpuinfo", gpus: bool = True) -> Inventory:
    """The machine's inventory. `gpus=False` skips the GPU probes (no CUDA initialisation)."""
    import psutil

    vm = psutil.virtual_memory()
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    try:
        features = parse_cpu_features(Path(cpuinfo).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        features = ()
    found: tuple[GPU, ...] = ()
    if gpus:
        nv = _nvml_gpus()
        found = nv if nv is not None else _torch_gpus()
    return Inventory(ram_total=int(vm.total), ram_available=int(vm.available), physical_cores=int(physical),
                     logical_cores=int(logical), cpu_features=features, gpus=found)
