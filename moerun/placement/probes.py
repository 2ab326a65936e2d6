"""Measuring this machine for the cost model: kernel, float and file-read probes, fixed overheads, and
`gather_rates` (flags, then the cache in hardware.json, then the probes, else the defaults) -> Rates.

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
    Workload,
    decode_time,
    parts_from_arch,
    prefill_time,
)


def _moe_sweep(cpu, x, calls, w, experts):
    """One fused-MoE call per routing in `calls` (each a fresh choice of experts)."""
    def sweep():
        for ids in calls:
            cpu.moe_ffn_experts(x, ids, w, experts)
    return sweep


def _typical_time(runs: int, fn, *args) -> float:
    """Seconds of the median of `runs` calls fn(*args). Not the fastest: a pass lasts milliseconds, and this
    kind of machine's memory bandwidth swings by tens of percent from one moment to the next (measured host
    read 27-47 GB/s on one VM within an hour), so the fastest pass describes a burst, and the estimate
    predicts runs that last seconds (bench/RESULTS.md, estimate vs bench)."""
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

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


def _as_loaded(cpu, t):
    """A copy of t as load_model holds weights in RAM: on huge pages, interleaved where the kernels take it."""
    from moerun.hostmem import host_empty
    from moerun.quant.qtypes import QTensor

    if cpu.can_interleave(t):
        return cpu.interleave(t)
    data = host_empty(t.nbytes).view(t.data.shape)
    data.copy_(t.data)
    return QTensor(data, t.qtype, t.shape)


def measure_kernels(threads: int, qtypes: list[str], *, runs: int = 9) -> dict:
    """Probe the CPU kernels per qtype: decode GB/s (one token through a ~128 MiB matrix) and prefill
    FLOP/s (the fused MoE kernel, 16 experts of 768 x 2048, 32 tokens per expert), and decode GB/s through the
    fused MoE kernel. Each figure is the median of `runs` passes (see _typical_time). Quantized bytes are
    quantized once and tiled (the values do not change the speed). {} when the kernels are not built."""
    import torch

    try:
        from moerun.kernels import cpu
    except ImportError:
        return {}
    if not cpu.available():
        return {}
    from moerun.experts.store import Expert
    from moerun.quant.qtypes import QTensor, QType
    from moerun.quant.quantize import quantize

    out: dict[str, dict] = {}
    before_t, before_k = torch.get_num_threads(), cpu.get_threads()
    torch.set_num_threads(threads)
    cpu.set_threads(threads)
    try:
        H, I, E, k = 2048, 768, 16, 8
        g = torch.Generator().manual_seed(0)
        for name in qtypes:
            if name in F32_NAMES or not cpu.supports(QType[name]):
                continue
            q = QType[name]
            raw_g = quantize(torch.randn(I, H, generator=g), q)
            raw_d = quantize(torch.randn(H, I, generator=g), q)
            reps = max(1, (128 << 20) // raw_g.numel())
            big = _as_loaded(cpu, QTensor.from_bytes(raw_g.reshape(I, -1).repeat(reps, 1), q, (I * reps, H)))
            x1 = torch.randn(1, H, generator=g)
            cpu.matmul(x1, big)
            gbps = big.data.numel() / _typical_time(runs, cpu.matmul, x1, big) / GB
            del big
            ex = {e: Expert(*(_as_loaded(cpu, QTensor.from_bytes(r, q, s)) for r, s in
                              ((raw_g, (I, H)), (raw_g, (I, H)), (raw_d, (H, I))))) for e in range(E)}
            T = 32 * E // k
            x = torch.randn(T, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            wts = torch.full((T, k), 1.0 / k)
            cpu.moe_ffn_experts(x, ids, wts, ex)
            flops = T * k * 3 * 2 * I * H / _typical_time(runs, cpu.moe_ffn_experts, x, ids, wts, ex)
            # decode through the fused MoE kernel: one token, k of 64 distinct experts (> any L3), new ones each call
            many = {e: Expert(*(_as_loaded(cpu, QTensor.from_bytes(r, q, s)) for r, s in
                                ((raw_g, (I, H)), (raw_g, (I, H)), (raw_d, (H, I))))) for e in range(64)}
            x1 = torch.randn(1, H, generator=g)
            calls = [torch.randperm(64, generator=g)[:k].reshape(1, k) for _ in range(32)]
            w1 = torch.full((1, k), 1.0 / k)
            cpu.moe_ffn_experts(x1, calls[0], w1, many)
            sweep = _moe_sweep(cpu, x1, calls[1:], w1, many)
            moe_gbps = (len(calls) - 1) * k * many[0].nbytes / _typical_time(runs, sweep) / GB
            del many
            out[name] = {"decode_gbps": gbps, "moe_decode_gbps": moe_gbps, "prefill_flops": flops}
    finally:
        torch.set_num_threads(before_t)
        cpu.set_threads(before_k)
    return out


def measure_float_flops(threads: int, runs: int = 5) -> float:
    """torch float32 batched matmul FLOP/s at the attention-score shape (32 heads, 512 x 128 x 512)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(32, 512, 128), torch.randn(32, 128, 512)
        torch.bmm(a, b)
        typical = _typical_time(runs, torch.bmm, a, b)
    finally:
        torch.set_num_threads(before)
    return 2 * 32 * 512 * 128 * 512 / typical


def probe_shape(spec) -> dict:
    """The overhead probe's shape for a model: its hidden size, attention and routing, expert FFN 32, small
    vocabulary (the probe's own weights are then ~20 MiB a layer, its experts negligible)."""
    return {"hidden": spec.hidden, "heads": spec.n_heads, "kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
            "experts": max(spec.n_experts, 1), "experts_used": max(spec.n_experts_used, 1), "ffn": 32}


def shape_key(shape: dict) -> str:
    return "h{hidden}-q{heads}-kv{kv_heads}-d{head_dim}-e{experts}-k{experts_used}".format(**shape)


def measure_overhead(threads: int, shape: dict, rates: Rates, n_gen: int = 48, n_prompt: int = 512) -> dict:
    """Fixed costs the byte and FLOP terms miss, measured on two synthetic models with the model's own
    attention and routing shape (`probe_shape`; Q8_0; 1 and 3 layers): decode `n_gen` tokens and run one
    `n_prompt`-token prompt on each, subtract what this module predicts for them with `rates` (bytes and
    FLOPs, no overhead), and fit: decode per layer = slope / 2 layers, per token = intercept; prefill per
    layer per token = prefill slope / 2 layers / n_prompt. Nothing is fitted to any benchmark file."""
    import tempfile

    import torch

    from moerun.arch import resolve
    from moerun.bench import time_gen, time_prompt
    from moerun.engine.kv_cache import KVPool, SeqKV
    from moerun.formats import open_model
    from moerun.loading import load_model
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    bare = Rates(ram_gbps=rates.ram_gbps, disk_gbps=rates.disk_gbps, layer_overhead_s=Figure(0.0, "probe"),
                 token_overhead_s=Figure(0.0, "probe"), default_qflops=rates.default_qflops,
                 float_flops=rates.float_flops, kernel_eff=rates.kernel_eff, kernel_gbps=rates.kernel_gbps,
                 qflops=rates.qflops)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dec, pre = {}, {}
    try:
        try:
            from moerun.kernels import cpu as kernels

            if kernels.available():
                kernels.set_threads(threads)
        except ImportError:
            pass
        with tempfile.TemporaryDirectory(prefix="moerun-probe-") as d:
            for layers in (1, 3):
                p = make_model(preset("tiny-qwen3moe", layers=layers, vocab=512, **shape),
                               Path(d) / f"probe{layers}.gguf", ftype="Q8_0", progress=False, threads=1)
                with open_model(p) as mf:
                    arch = resolve(mf)
                w = Workload(arch.spec.n_layers, arch.spec.n_experts, arch.spec.n_experts_used, arch.spec.hidden,
                             arch.spec.n_heads, arch.spec.head_dim, parts_from_arch(arch), (1.0,) * layers,
                             "resident")
                m = load_model(str(p), dtype=torch.float32)
                pool = KVPool(m.arch.spec, n_prompt + n_gen + 8, dtype=m.model.dtype)
                tok = torch.randint(0, 512, (n_prompt,), generator=torch.Generator().manual_seed(0))
                ds, ps = [], []
                for _ in range(3):
                    seq = SeqKV(pool, n_gen + 4)
                    try:
                        ds.append(time_gen(m.model, seq, 1, n_gen) / n_gen / 1e9)
                    finally:
                        seq.free()
                for _ in range(2):
                    seq = SeqKV(pool, n_prompt + 4)
                    try:
                        ps.append(time_prompt(m.model, seq, tok, n_prompt) / 1e9)
                    finally:
                        seq.free()
                dec[layers] = min(ds) - decode_time(w, bare).total
                pre[layers] = min(ps) - prefill_time(w, bare, n_prompt, n_prompt).seconds
                del m, pool
    finally:
        torch.set_num_threads(before)
    layer = max((dec[3] - dec[1]) / 2, 0.0)
    return {"layer_s": layer, "token_s": max(dec[1] - layer, 0.0),
            "prefill_layer_token_s": max((pre[3] - pre[1]) / 2 / n_prompt, 0.0),
            "residual_s": {"decode": {str(k): v for k, v in dec.items()},
                           "prefill": {str(k): v for k, v in pre.items()}}}


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
    measure: bool = False
    ram_gbps: float | None = None
    disk_gbps: float | None = None
    h2d_gbps: float | None = None  # given host-to-device copy bandwidth (GPU runs)
    vram_gbps: float | None = None  # given GPU memory bandwidth
    model_path: str | None = None
    qtypes: list[str] = field(default_factory=list)
    gpu: object | None = None  # moerun.placement.devices.GPU of the first compute device, if any
    shape: dict | None = None  # probe_shape(spec) of the model: the overhead figures are kept per shape


SEC_FILE_READ = "file_read_gbps"  # hardware.json: measure_file_read's figure, keyed by the file's path


def _file_read_rate(opt: RateOptions, cache: Path | None) -> Figure:
    """The model file's read rate: measured (and cached) with opt.measure, else cached for this file (the rate
    depends on the disk it lives on and on how much of it the page cache holds), else the default."""
    if not opt.model_path:
        return Figure(DEFAULT_DISK_GBPS, "default")
    key = str(Path(opt.model_path).resolve())
    if opt.measure:
        gbps = measure_file_read(opt.model_path)
        _store(SEC_FILE_READ, key, {"gbps": gbps, "measured_at": _now()}, cache)
        return Figure(gbps, "measured")
    gbps = (_cached(SEC_FILE_READ, key, cache) or {}).get("gbps")
    if isinstance(gbps, (int, float)) and not isinstance(gbps, bool) and gbps > 0:
        return Figure(float(gbps), "cached")
    return Figure(DEFAULT_DISK_GBPS, "default")


def gather_rates(opt: RateOptions, cache: Path | None = None) -> Rates:
    """Rates from flags, then the cache, then (with measure) the probes, else the defaults. With measure,
    every probe runs now and is stored in the cache."""
    t = opt.threads
    if opt.ram_gbps is not None:
        ram = Figure(opt.ram_gbps, "given")
    else:
        v, src = bw_mod.host_read_bandwidth(t, measure=opt.measure, path=cache)
        ram = Figure(v, src)
    if opt.disk_gbps is not None:
        disk = Figure(opt.disk_gbps, "given")
    else:
        disk = _file_read_rate(opt, cache)

    if opt.measure:
        ks = measure_kernels(t, sorted(set(opt.qtypes) | {"Q8_0"}))
        if ks:
            prev = (_cached(SEC_KERNEL, t, cache) or {})
            _store(SEC_KERNEL, t, {**prev, **{q: {"gbps": v["decode_gbps"], "moe_gbps": v["moe_decode_gbps"],
                                                 "flops": v["prefill_flops"], "measured_at": _now()}
                                             for q, v in ks.items()}}, cache)
        _store(SEC_FLOAT, t, {"flops": measure_float_flops(t), "measured_at": _now()}, cache)
    label = "measured" if opt.measure else "cached"
    kern = _cached(SEC_KERNEL, t, cache) or {}

    def pick(key: str, qtypes) -> tuple[tuple[str, Figure], ...]:
        return tuple((q, Figure(float(v[key]), label)) for q, v in sorted(kern.items())
                     if isinstance(v, dict) and q in qtypes and isinstance(v.get(key), (int, float)) and v[key] > 0)

    fl = _cached(SEC_FLOAT, t, cache)
    float_flops = Figure(float(fl["flops"]), label) if fl and fl.get("flops") else \
        Figure(DEFAULT_FLOAT_FLOPS_PER_THREAD * t, "default")
    rates = Rates(ram_gbps=ram, disk_gbps=disk, layer_overhead_s=Figure(DEFAULT_LAYER_OVERHEAD_S, "default"),
                  token_overhead_s=Figure(DEFAULT_TOKEN_OVERHEAD_S, "default"),
                  default_qflops=Figure(DEFAULT_QFLOPS_PER_THREAD * t, "default"), float_flops=float_flops,
                  kernel_gbps=pick("gbps", opt.qtypes), moe_gbps=pick("moe_gbps", opt.qtypes),
                  qflops=pick("flops", opt.qtypes),
                  prefill_overhead_s=Figure(DEFAULT_PREFILL_OVERHEAD_S, "default"))
    key = shape_key(opt.shape) if opt.shape else None
    if opt.measure and opt.shape:
        probe_rates = replace(rates, kernel_gbps=pick("gbps", {"Q8_0", *opt.qtypes}),
                              moe_gbps=pick("moe_gbps", {"Q8_0", *opt.qtypes}),
                              qflops=pick("flops", {"Q8_0", *opt.qtypes}))
        o = measure_overhead(t, opt.shape, probe_rates)
        prev = _cached(SEC_OVERHEAD, t, cache) or {}
        _store(SEC_OVERHEAD, t, {**prev, key: {**o, "measured_at": _now()}}, cache)
    ov = (_cached(SEC_OVERHEAD, t, cache) or {}).get(key) if key else None
    if isinstance(ov, dict) and isinstance(ov.get("layer_s"), (int, float)):
        rates = replace(rates, layer_overhead_s=Figure(float(ov["layer_s"]), label),
                        token_overhead_s=Figure(float(ov.get("token_s", 0.0)), label),
                        prefill_overhead_s=Figure(float(ov.get("prefill_layer_token_s", 0.0)), label))
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
