"""Measuring this machine for the cost model: kernel, float and file-read probes, fixed overheads, and
`gather_rates` (flags, then the cache in hardware.json, then the probes, else the defaults) -> Rates.

Every probe records the machine's load during it and its spread over repeated passes beside its figure
(moerun.placement.load); a figure taken under load, or too noisy, is marked untrusted and measured again the next
time the probes may run and the machine is quiet. `used_probes` gives the cache entries behind a Rates' figures,
for the commands that print their age and load.

The arithmetic lives in costmodel.py; this module only produces its inputs.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from moerun.placement import bandwidth as bw_mod
from moerun.placement import load
from moerun.placement.costmodel import (
    DEFAULT_DEVICE_GBPS,
    DEFAULT_DISK_GBPS,
    DEFAULT_FLOAT_FLOPS_PER_THREAD,
    DEFAULT_H2D_GBPS,
    DEFAULT_LAYER_OVERHEAD_S,
    DEFAULT_PREFILL_OVERHEAD_S,
    DEFAULT_QFLOPS_PER_THREAD,
    DEFAULT_TOKEN_OVERHEAD_S,
    F32_NAMES,
    GB,
    LINK_EFF,
    SEC_FLOAT,
    SEC_KERNEL,
    SEC_OVERHEAD,
    Figure,
    Rates,
)


def _typical_time(runs: int, fn, *args) -> tuple[float, float | None]:
    """(seconds of the median of `runs` calls fn(*args), their spread: load.spread). Not the fastest: a pass
    lasts milliseconds, and this kind of machine's memory bandwidth swings by tens of percent from one moment to
    the next (measured host read 27-47 GB/s on one VM within an hour), so the fastest pass describes a burst,
    and the estimate predicts runs that last seconds (bench/RESULTS.md, estimate vs bench)."""
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), load.spread(ts)


def _cached(section: str, key: int | str, path: Path | None = None):
    """A section's entry for `key` (a thread count; for the file read, the file)."""
    sec = bw_mod.load_cache(path).get(section, {})
    entry = sec.get(str(key)) if isinstance(sec, dict) else None
    return entry if isinstance(entry, dict) else None


def _store(section: str, key: int | str, entry: dict, path: Path | None = None) -> None:
    data = bw_mod.load_cache(path)
    sec = data.get(section)
    if not isinstance(sec, dict):
        sec = data[section] = {}
    old = sec.get(str(key))
    sec[str(key)] = {**(old if isinstance(old, dict) else {}), **entry}
    bw_mod.save_cache(data, path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_kernels(threads: int, qtypes: list[str], *, runs: int = 9) -> dict:
    """Probe the CPU kernels per qtype: decode GB/s (one token through a ~128 MiB matrix) and prefill
    FLOP/s (the fused MoE kernel, 16 experts of 768 x 2048, 32 tokens per expert). Each figure is the median
    of `runs` passes (see _typical_time); "spread" is the wider of the two probes' spreads. Quantized bytes are
    quantized once and tiled (the values do not change the speed). {} when the kernels are not built. What
    decoding the model's own layers costs beyond these rates is the layer probe's (moerun.placement.layer_probe)."""
    import torch

    try:
        from moerun.kernels import cpu
    except ImportError:
        return {}
    if not cpu.available():
        return {}
    from moerun.experts.store import Expert
    from moerun.placement.layer_probe import Tiles
    from moerun.quant.qtypes import QType, row_bytes

    out: dict[str, dict] = {}
    before_t, before_k = torch.get_num_threads(), cpu.get_threads()
    torch.set_num_threads(threads)
    cpu.set_threads(threads)
    try:
        H, I, E, k = 2048, 768, 16, 8
        g = torch.Generator().manual_seed(0)
        tiles = Tiles()
        for name in qtypes:
            if name in F32_NAMES or not cpu.supports(QType[name]):
                continue
            q = QType[name]
            big = tiles(q, ((128 << 20) // row_bytes(q, H) // 8 * 8, H))  # ~128 MiB, far beyond any cache
            x1 = torch.randn(1, H, generator=g)
            cpu.matmul(x1, big)
            secs, dec_spread = _typical_time(runs, cpu.matmul, x1, big)
            gbps = big.data.numel() / secs / GB
            del big
            ex = {e: Expert(tiles(q, (I, H)), tiles(q, (I, H)), tiles(q, (H, I))) for e in range(E)}
            T = 32 * E // k
            x = torch.randn(T, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            wts = torch.full((T, k), 1.0 / k)
            cpu.moe_ffn_experts(x, ids, wts, ex)
            secs, pre_spread = _typical_time(runs, cpu.moe_ffn_experts, x, ids, wts, ex)
            flops = T * k * 3 * 2 * I * H / secs
            out[name] = {"decode_gbps": gbps, "prefill_flops": flops,
                         "spread": max((v for v in (dec_spread, pre_spread) if v is not None), default=None)}
    finally:
        torch.set_num_threads(before_t)
        cpu.set_threads(before_k)
    return out


def measure_float_flops(threads: int, runs: int = 5) -> dict:
    """torch float32 batched matmul FLOP/s at the attention-score shape (32 heads, 512 x 128 x 512) ->
    {"flops", "spread"}."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(32, 512, 128), torch.randn(32, 128, 512)
        torch.bmm(a, b)
        typical, spread = _typical_time(runs, torch.bmm, a, b)
    finally:
        torch.set_num_threads(before)
    return {"flops": 2 * 32 * 512 * 128 * 512 / typical, "spread": spread}


def measure_file_read(path: str | Path, nbytes: int = 256 << 20, piece: int = 4 << 20, seed: int = 0) -> float:
    """GB/s reading `nbytes` of `path` the way expert-cache misses do: `piece`-sized positioned reads (about
    one expert) at random places across the whole file. Whatever part of the file the page cache holds serves
    its share, the rest comes from the disk, so the figure is what a miss sees in this state of the cache
    (a sequential read of one region would see only that region's state)."""
    import random

    size = os.path.getsize(path)
    piece = max(4096, min(piece, size)) & ~4095 or size
    n_pieces = max(1, min(nbytes, size) // piece)
    offsets = random.Random(seed).sample(range(max(1, size // piece)), min(n_pieces, max(1, size // piece)))
    buf = bytearray(piece)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        done = 0
        for k in offsets:
            got = os.preadv(fd, [mv[: min(piece, size - k * piece)]], k * piece)
            if got <= 0:
                break
            done += got
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return done / dt / GB if dt > 0 and done else 0.0


@dataclass
class RateOptions:
    threads: int = 1
    # True: run every probe now (`estimate --measure`); None: run, quickly, the probes whose figures the cache
    # lacks (estimate's default); False: the cache and the defaults only (the runtime, `--no-measure`)
    measure: bool | None = False
    ram_gbps: float | None = None
    disk_gbps: float | None = None
    h2d_gbps: float | None = None  # given host-to-device copy bandwidth (GPU runs)
    vram_gbps: float | None = None  # given GPU memory bandwidth
    model_path: str | None = None
    reads_file: bool = False  # the plan reads routed experts from the model file: its read rate matters
    qtypes: list[str] = field(default_factory=list)
    gpu: object | None = None  # moerun.placement.devices.GPU of the first compute device, if any
    layout: dict | None = None  # layer_probe.probe_layout(arch): the layer figures are kept per layout
    progress: bool = False  # a bar of the probes on stderr while they run (moerun.progress)


@dataclass(frozen=True)
class Effort:
    """How hard the probes work: `quick` is estimate's default (3-6 s for the a3b files on 2 cores), `full`
    --measure."""

    ram_bytes: int
    ram_runs: int
    kernel_runs: int
    float_runs: int
    layer_rounds: int
    layer_tokens: int
    prompt_runs: int


QUICK = Effort(ram_bytes=512 << 20, ram_runs=3, kernel_runs=5, float_runs=3, layer_rounds=8, layer_tokens=12,
               prompt_runs=2)
FULL = Effort(ram_bytes=1 << 30, ram_runs=5, kernel_runs=9, float_runs=5, layer_rounds=16, layer_tokens=24,
              prompt_runs=3)


SEC_FILE_READ = "file_read_gbps"  # hardware.json: measure_file_read's figure, keyed by the file's path


class _Quiet:
    """Whether the machine is quiet now (load.quiet_now), looked at once, the first time it is asked."""

    def __init__(self):
        self.answer: bool | None = None

    def __call__(self) -> bool:
        if self.answer is None:
            self.answer = load.is_quiet(load.quiet_now())
        return self.answer


def _file_read_rate(opt: RateOptions, cache: Path | None, quiet=lambda: False) -> Figure:
    """The model file's read rate: measured (and cached) with opt.measure (or, quick, when the plan reads the
    file and nothing trusted is cached while the machine is quiet), else cached for this file (the rate depends on
    the disk it lives on and on how much of it the page cache holds), else the default."""
    if not opt.model_path:
        return Figure(DEFAULT_DISK_GBPS, "default")
    key = str(Path(opt.model_path).resolve())
    entry = _cached(SEC_FILE_READ, key, cache) or {}
    gbps = entry.get("gbps")
    known = isinstance(gbps, (int, float)) and not isinstance(gbps, bool) and gbps > 0
    if opt.measure or (opt.measure is None and opt.reads_file and (not known or (not load.trusted(entry) and quiet()))):
        with load.Watch() as w:
            gbps = measure_file_read(opt.model_path)
        _store(SEC_FILE_READ, key, load.mark({"gbps": gbps, "measured_at": _now()}, w.load), cache)
        return Figure(gbps, "measured")
    return Figure(float(gbps), "cached") if known else Figure(DEFAULT_DISK_GBPS, "default")


PROBES = ("host read", "file read", "kernels", "torch float32", "layers")  # gather_rates' steps, in order


def gather_rates(opt: RateOptions, cache: Path | None = None) -> Rates:
    """Rates from flags, then the cache, then the defaults; the probes run first as opt.measure says (every
    one, or those whose figures the cache lacks or holds untrusted while the machine is quiet now), each storing
    what it measured in the cache with the load during it. opt.progress: a bar of the probes on stderr."""
    from moerun.progress import bar

    with bar(opt.progress and opt.measure is not False, "probing", len(PROBES), unit="probe") as step:
        return _gather(opt, cache, step)


def _gather(opt: RateOptions, cache: Path | None, step) -> Rates:
    t, full = opt.threads, opt.measure is True
    effort = FULL if full else QUICK
    quiet = _Quiet()

    def due(entry) -> bool:
        return full or (opt.measure is None and (not entry or (not load.trusted(entry) and quiet())))

    if opt.ram_gbps is not None:
        ram = Figure(opt.ram_gbps, "given")
    else:
        due_ram = due(bw_mod.cached_host_read_bandwidth(t, cache))
        v, src = bw_mod.host_read_bandwidth(t, measure=due_ram, path=cache, nbytes=effort.ram_bytes,
                                            runs=effort.ram_runs)
        ram = Figure(v, src)
    step(1)
    disk = Figure(opt.disk_gbps, "given") if opt.disk_gbps is not None else _file_read_rate(opt, cache, quiet)
    step(1)

    quantized = sorted(q for q in set(opt.qtypes) if q not in F32_NAMES)
    kern = _cached(SEC_KERNEL, t, cache) or {}
    todo = [q for q in quantized if due(kern.get(q))]
    fresh: set[str] = set()
    if todo:
        with load.Watch() as w:
            ks = measure_kernels(t, todo, runs=effort.kernel_runs)
        _store(SEC_KERNEL, t, {q: load.mark({"gbps": v["decode_gbps"], "flops": v["prefill_flops"],
                                             "measured_at": _now()}, w.load, v.get("spread"))
                               for q, v in ks.items()}, cache)
        kern, fresh = _cached(SEC_KERNEL, t, cache) or {}, set(ks)
    step(1)

    def pick(key: str) -> tuple[tuple[str, Figure], ...]:
        return tuple((q, Figure(float(v[key]), "measured" if q in fresh else "cached"))
                     for q, v in sorted(kern.items()) if q in quantized and isinstance(v, dict)
                     and isinstance(v.get(key), (int, float)) and v[key] > 0)

    fl = _cached(SEC_FLOAT, t, cache)
    if due(fl):
        with load.Watch() as w:
            got = measure_float_flops(t, runs=effort.float_runs)
        _store(SEC_FLOAT, t, load.mark({"flops": got["flops"], "measured_at": _now()}, w.load, got.get("spread")),
               cache)
        fl = dict(_cached(SEC_FLOAT, t, cache) or {}, fresh=True)
    float_flops = Figure(float(fl["flops"]), "measured" if fl.get("fresh") else "cached") if fl and fl.get("flops") \
        else Figure(DEFAULT_FLOAT_FLOPS_PER_THREAD * t, "default")
    step(1)
    rates = Rates(ram_gbps=ram, disk_gbps=disk, layer_overhead_s=Figure(DEFAULT_LAYER_OVERHEAD_S, "default"),
                  token_overhead_s=Figure(DEFAULT_TOKEN_OVERHEAD_S, "default"),
                  default_qflops=Figure(DEFAULT_QFLOPS_PER_THREAD * t, "default"), float_flops=float_flops,
                  kernel_gbps=pick("gbps"), qflops=pick("flops"),
                  prefill_overhead_s=Figure(DEFAULT_PREFILL_OVERHEAD_S, "default"))
    if opt.layout:
        from moerun.placement.layer_probe import layout_key, measure_layers

        key = layout_key(opt.layout)
        ov = (_cached(SEC_OVERHEAD, t, cache) or {}).get(key)
        label = "cached"
        if due(ov):
            with load.Watch() as w:
                ov = measure_layers(t, opt.layout, rates, rounds=effort.layer_rounds, n_gen=effort.layer_tokens,
                                    prompt_runs=effort.prompt_runs)
            ov = load.mark({**ov, "measured_at": _now()}, w.load, ov.get("spread"))
            _store(SEC_OVERHEAD, t, {key: ov}, cache)
            label = "measured"
        if isinstance(ov, dict) and isinstance(ov.get("layer_s"), (int, float)):
            rates = replace(rates, layer_overhead_s=Figure(float(ov["layer_s"]), label),
                            token_overhead_s=Figure(float(ov.get("token_s", 0.0)), label),
                            prefill_overhead_s=Figure(float(ov.get("prefill_layer_token_s", 0.0)), label))
    step(1)
    h2d = dev = None
    g = opt.gpu
    if g is not None:
        h2d = Figure(g.pcie_gbps * LINK_EFF, "default") if g.pcie_gbps else Figure(DEFAULT_H2D_GBPS, "default")
        dev = Figure(g.mem_bandwidth_gbps * LINK_EFF, "default") if g.mem_bandwidth_gbps else \
            Figure(DEFAULT_DEVICE_GBPS, "default")
    if g is not None and opt.h2d_gbps is not None:
        h2d = Figure(opt.h2d_gbps, "given")
    if g is not None and opt.vram_gbps is not None:
        dev = Figure(opt.vram_gbps, "given")
    return replace(rates, h2d_gbps=h2d, device_gbps=dev)


def used_probes(opt: RateOptions, rates: Rates, cache: Path | None = None) -> dict[str, dict]:
    """The cache entries behind `rates`' measured and cached figures that this plan uses (after gather_rates with
    the same options), by name: "host read", "file read", "kernel Q4_K", ..., "torch float32", "overhead"; each holds its
    measured_at and, where the probe recorded them, its load, spread and verdict (moerun.placement.load)."""
    t, out = opt.threads, {}

    def probed(fig) -> bool:
        return fig is not None and fig.source in ("measured", "cached")

    if probed(rates.ram_gbps):
        out["host read"] = bw_mod.cached_host_read_bandwidth(t, cache)
    if probed(rates.disk_gbps) and opt.model_path and opt.reads_file:
        out["file read"] = _cached(SEC_FILE_READ, str(Path(opt.model_path).resolve()), cache)
    kern = _cached(SEC_KERNEL, t, cache) or {}
    for q, fig in rates.kernel_gbps:
        if probed(fig):
            out[f"kernel {q}"] = kern.get(q)
    if probed(rates.float_flops):
        out["torch float32"] = _cached(SEC_FLOAT, t, cache)
    if probed(rates.layer_overhead_s) and opt.layout:
        from moerun.placement.layer_probe import layout_key

        out["overhead"] = (_cached(SEC_OVERHEAD, t, cache) or {}).get(layout_key(opt.layout))
    return {k: v for k, v in out.items() if isinstance(v, dict)}
