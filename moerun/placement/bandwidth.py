"""Host memory read bandwidth: measured once per thread count, cached as JSON.

The figure is what the CPU kernels' thread pool reaches streaming a large buffer (1 GiB by default, far
larger than any cache) with `n` threads, the way the kernels read weights (torch's sum where the kernels are
not built): the median of several passes, in GB/s (1e9 bytes per second). It is the `bw(cpu_ram)` of the cost
model and the ceiling `moerun bench` compares decode speed against.

The cache is `$MOERUN_CACHE/hardware.json` (default `~/.cache/moerun/hardware.json`):

    {"host_read_bandwidth": {"2": {"gbps": 21.3, "measured_at": "2026-12-01T10:00:00+00:00",
                                   "bytes": 1073741824, "runs": 5, "samples_gbps": [...]}}}

keyed by thread count. A measurement adds the load during it and its verdict (moerun.placement.load: "load",
"spread", "trusted", "why"); an entry without them, from an older moerun, reads as before and counts as trusted.
`moerun bench` raises the figure when a decode test read more than it (`raise_to_floor`: bytes per token x t/s is
a floor on what the machine reads, once a token's bytes are far more than the last-level cache holds).
Other keys in the file are kept as they are (other measurements live there too).
Nothing here keeps state between calls: every function reads or writes the file it is given.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from moerun.placement import load

DEFAULT_HOST_READ_GBPS = 20.0  # a dual-channel DDR4 desktop; used until a measurement exists
CACHE_FILE = "hardware.json"
SECTION = "host_read_bandwidth"


def cache_dir() -> Path:
    """`$MOERUN_CACHE`, else `~/.cache/moerun`."""
    env = os.environ.get("MOERUN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moerun"


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def load_cache(path: Path | None = None) -> dict:
    """The whole cache file as a dict; {} when it is missing or unreadable (a bad cache is not an error)."""
    path = path or cache_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_cache(data: dict, path: Path | None = None) -> None:
    """Write the cache atomically (temporary file + rename), creating the folder."""
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".hardware-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# (streams per thread, prefetch distance in bytes) the kernel-pool probe tries; the best median counts
READ_PATTERNS = ((1, 0), (4, 0), (8, 0), (4, 512))
# the kernel-pool probe's revision: cached figures of an older one are measured again (2: register accumulators;
# the first kept them in memory and read ~20 GB/s on one thread where the matvec kernels stream 31)
PROBE_REVISION = 2


def measure_host_read_bandwidth(threads: int, nbytes: int = 1 << 30, runs: int = 5) -> dict:
    """Read `nbytes` with `threads` threads, `runs` timed passes after one warm-up, the way the kernels stream
    weights: the C probe (moerun.kernels: 32-byte loads on the kernel pool from memory on huge pages, each thread
    its own share as one or several interleaved streams, with and without software prefetch; the best pattern's
    median counts), else torch summing a float32 tensor.

    -> {"gbps": median GB/s, "samples_gbps": [...], "bytes", "runs", "method", "measured_at"}. The thread
    counts are restored afterwards. Issue 21: torch's sum read 28-32 GB/s where the best decode moves 35."""
    import torch

    if threads < 1 or runs < 1:
        raise ValueError("threads and runs must be positive")
    try:
        from moerun.kernels import cpu
    except ImportError:
        cpu = None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if cpu is not None and cpu.available():
            method, samples = _kernel_probe(cpu, threads, nbytes, runs)
        else:
            method, samples = "torch.sum", _torch_probe(nbytes, runs)
    finally:
        torch.set_num_threads(before)
    return {"gbps": statistics.median(samples), "samples_gbps": [round(s, 3) for s in samples], "bytes": nbytes,
            "runs": runs, "method": method, "probe": PROBE_REVISION,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _torch_probe(nbytes: int, runs: int) -> list[float]:
    import torch

    x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)  # ones, not empty: pages must be resident
    x.sum()  # warm-up
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        x.sum()
        samples.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return samples


def _kernel_probe(cpu, threads: int, nbytes: int, runs: int) -> tuple[str, list[float]]:
    from moerun.hostmem import host_empty

    nbytes = max(nbytes, 1 << 20) // 4096 * 4096
    buf = host_empty(nbytes)
    buf.fill_(1)  # resident
    before = cpu.get_threads()
    cpu.set_threads(threads)
    best: tuple[float, str, list[float]] | None = None
    try:
        for streams, prefetch in READ_PATTERNS:
            cpu.read_bw(buf, streams, prefetch)  # warm-up
            samples = []
            for _ in range(runs):
                t0 = time.perf_counter()
                cpu.read_bw(buf, streams, prefetch)
                samples.append(nbytes / (time.perf_counter() - t0) / 1e9)
            med = statistics.median(samples)
            if best is None or med > best[0]:
                best = (med, f"kernel pool, {streams} stream(s) per thread, prefetch {prefetch} B", samples)
    finally:
        cpu.set_threads(before)
    return best[1], best[2]


def cached_host_read_bandwidth(threads: int, path: Path | None = None) -> dict | None:
    """The cached entry for `threads`, or None (also for a kernel-pool figure of an older probe revision)."""
    entry = load_cache(path).get(SECTION, {}).get(str(threads))
    if not (isinstance(entry, dict) and isinstance(entry.get("gbps"), (int, float)) and entry["gbps"] > 0):
        return None
    if str(entry.get("method", "")).startswith("kernel pool") and entry.get("probe", 1) < PROBE_REVISION:
        return None
    return entry


def store_host_read_bandwidth(threads: int, entry: dict, path: Path | None = None) -> None:
    """Record `entry` (as returned by measure_host_read_bandwidth) for `threads`, keeping everything else."""
    data = load_cache(path)
    section = data.get(SECTION)
    if not isinstance(section, dict):
        section = data[SECTION] = {}
    section[str(threads)] = entry
    save_cache(data, path)


def host_read_bandwidth(threads: int, measure: bool = False, path: Path | None = None,
                        nbytes: int = 1 << 30, runs: int = 5) -> tuple[float, str]:
    """Host RAM read bandwidth with `threads` threads -> (GB/s, source).

    source is "measured" (measure=True: measured now and cached), "cached" (a previous measurement), or
    "default" (nothing measured yet: DEFAULT_HOST_READ_GBPS).
    """
    if measure:
        with load.Watch() as w:
            entry = measure_host_read_bandwidth(threads, nbytes=nbytes, runs=runs)
        entry = load.mark(entry, w.load, load.spread(entry.get("samples_gbps")))
        store_host_read_bandwidth(threads, entry, path)
        return float(entry["gbps"]), "measured"
    entry = cached_host_read_bandwidth(threads, path)
    if entry is not None:
        return float(entry["gbps"]), "cached"
    return DEFAULT_HOST_READ_GBPS, "default"


def bench_host_read(threads: int, measure: bool = False, log=lambda s: None,
                    rerun: str = "re-run with --measure-bw when quiet") -> tuple[float, str]:
    """`moerun bench`'s figure for `threads` -> (GB/s, source), its line logged (value, age, load): measured
    fully with `measure`; else the cached one, measured quickly (256 MiB, 3 passes a pattern, well under a second)
    where none is cached, or where the cached one is untrusted and the machine is quiet now, so that "% of bound"
    is never against the built-in default or a figure probed under load."""
    entry = cached_host_read_bandwidth(threads)
    stale = not measure and entry is not None and not load.trusted(entry) and load.is_quiet(load.quiet_now())
    quick = not measure and (entry is None or stale)
    if stale:
        log(f"the cached host read figure ({float(entry['gbps']):.1f} GB/s) was {load.describe(entry)}; the "
            "machine is quiet now: measuring it again")
    if measure or quick:
        log(f"measuring host read bandwidth with {threads} thread(s)...")
    gbps, source = host_read_bandwidth(threads, measure=measure or quick, **({"nbytes": 1 << 28, "runs": 3}
                                                                            if quick else {}))
    log(load.note(f"host read {gbps:.1f} GB/s ({threads} thread(s))", cached_host_read_bandwidth(threads), rerun))
    return gbps, source


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (cpu0's highest index), 32 MiB where sysfs does not say."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        try:
            best = max(best, int(text.rstrip("KMGkmg")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


def raise_to_floor(threads: int, gbps: float, what: str, path: Path | None = None) -> dict | None:
    """Store `gbps`, read by a run (`what`: "moerun bench tg128 ..."), as the host read figure for `threads` when it
    is above the cached one (or none is cached) -> the entry stored, or None where the cached figure is higher."""
    old = cached_host_read_bandwidth(threads, path)
    if old is not None and float(old["gbps"]) >= gbps:
        return None
    entry = {"gbps": gbps, "method": what, "probe": PROBE_REVISION, "floor": True,
             "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "load": None, "spread": None,
             "trusted": True, "why": "a floor read by a run",
             "replaced_gbps": None if old is None else float(old["gbps"])}
    store_host_read_bandwidth(threads, entry, path)
    return entry
