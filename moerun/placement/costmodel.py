"""The cost model (DESIGN.md, "The cost model", decision 4): one module, used by `moerun estimate` now and by
the MoE layer's miss path later. Pure functions over frozen dataclasses; the probes that measure the
machine sit at the end of the file and are the only code here that runs torch or touches a cache file.

Units: bytes, seconds, GB/s (1e9 bytes/s), FLOP/s.

Inputs
------
`Rates` — what the machine does, each figure a `Figure(value, source)`; source is "measured" (probed now),
"cached" (an earlier probe, in `$MOERUN_CACHE/hardware.json`), "given" (a command-line flag) or "default"
(a documented constant below):

- ram_gbps      host RAM read bandwidth (`moerun.placement.bandwidth`: torch summing 1 GiB).
- disk_gbps     read bandwidth of the home tier when it is the memory-mapped file ("disk"); measured by
                reading the model file with pread (the page cache may serve it: then it is what a warm run
                sees).
- h2d_gbps      host-to-device copy bandwidth (GPU only; default: 80% of the PCIe link NVML reports).
- device_gbps   GPU memory bandwidth (GPU only; default: 80% of bus width x memory clock).
- kernel_gbps   per qtype: the GB/s the CPU kernels stream weights at in decode (one token); measured by
                one large matmul per qtype, else `DEFAULT_KERNEL_EFF` x ram_gbps.
- moe_gbps      per qtype: the same for the fused MoE kernel (one token, k of 64 distinct experts per call,
                new experts each call), used for the routed experts.
- qflops        per qtype: FLOP/s of the CPU kernels in prefill (the fused MoE kernel, 32 tokens per
                expert); measured, else `DEFAULT_QFLOPS_PER_THREAD` x threads.
- float_flops   FLOP/s of torch float32 batched matmuls (attention scores over the prompt in prefill).
- layer_overhead_s  fixed seconds per layer per forward step (Python, torch dispatch, norms, RoPE, routing,
                kernel launches), measured by decoding on a tiny model with the benchmark's routing shape
                (128 experts, top-8) and no weight bytes to speak of, at two depths: the slope.
- token_overhead_s  fixed seconds per forward step outside the layers (embedding lookup, head, argmax):
                the intercept of the same probe.
- prefill_overhead_s  seconds per layer per prompt token that prefill costs beyond its FLOP terms, from
                the same probe running a 512-token prompt (see `measure_overhead`).

`Workload` — what one token costs, from the model and the placement plan (`workload()` builds it).

Decode (one token)
------------------
    dense        = sum over non-expert tensors of bytes / rate(where it lives)  (attention, routers, norms,
                   shared experts; rate = device GB/s on a GPU, the CPU kernel GB/s of its qtype in RAM)
    experts hit  = sum over MoE layers of k/E x bytes(layer) x h(layer) / rate(where the slots are)
    experts miss = sum over MoE layers of k/E x bytes(layer) x (1 - h(layer)) x miss cost per byte
    overhead     = n_layers x layer_overhead_s + token_overhead_s
    head         = (output norm + LM head + one embedding row) / rate
    tok/s        = 1 / (dense + experts hit + experts miss + overhead + head)

h(layer) is the cache hit rate: 1 when the experts are resident (home = RAM, CPU compute: nothing is
paged), slots/E under uniform routing, or the decode hit rate of a routing trace replayed against the
cache (`moerun.experts.trace.simulate`). The *bound* is the same sum with every rate at its raw tier
bandwidth (no kernel efficiency) and no overhead; the *expectation* uses kernel rates and overheads.

Miss cost (`miss_time`, `miss_choice`), DESIGN's min():
    fetch: bytes_e / link + bytes_e / compute      page the expert in (h2d on a GPU, a pread from the file
                                                   into a RAM slot on the CPU), then compute on the device
    home:  bytes_e / home + 2 n hidden 4 / h2d + launch    compute where the expert lives, ship activations
On a CPU-only plan the runtime always fetches (DESIGN decision 10: the map is never the cache), so the
estimate uses "fetch" there; on a GPU plan it uses the cheaper of the two.

Prefill (n tokens, in ubatches of `ubatch`)
-------------------------------------------
    per layer and ubatch of m tokens:
      compute = sum over tensors of 2 x params x m x (k/E for routed experts) / qflops(qtype)
              + 4 x n_heads x head_dim x m x (context so far + (m+1)/2) / float_flops   (causal attention)
      memory  = dense bytes / rate + bytes of the experts touched (min(E, m k) of E) / rate(home)
      time    = max(compute, memory) + m x prefill_overhead_s
    pp tok/s = n / (sum over ubatches and layers + head on the last token);  TTFT = that time.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from moerun.placement import bandwidth as bw_mod

GB = 1e9

# ---------------------------------------------------------------------------------------------- defaults
# Used when nothing has been measured; each is labelled "default" wherever it is printed.
DEFAULT_DISK_GBPS = 2.0  # one NVMe SSD, sequential reads (a SATA SSD is ~0.5, the page cache ~10)
DEFAULT_H2D_GBPS = 12.0  # PCIe 4.0 x16 pageable copies, when NVML gives no link figure
DEFAULT_DEVICE_GBPS = 500.0  # a mid-range GPU, when NVML/torch gives no memory figure
LINK_EFF = 0.8  # fraction of the nominal PCIe / memory figure copies and kernels reach
# The CPU kernels stream quantized weights at ~85% of the host read bandwidth in decode: bench/kernels_cpu.py
# measured 27 GB/s (fused MoE) and 26 GB/s (matmul) against 31.8 GB/s host read, Zen 4, 2 threads.
DEFAULT_KERNEL_EFF = 0.85
# Prefill FLOP rate per thread of the CPU kernels and of torch float32 batched matmuls: the probes' figures on
# the development machine (Zen 4, AVX-512 VNNI, 2 threads: kernels 206-240 GFLOP/s for K-quants, 160 for
# Q8_0; torch 101-170), rounded down. An AVX2-only core reaches about half.
DEFAULT_QFLOPS_PER_THREAD = 100e9
DEFAULT_QFLOPS_FACTOR = {"Q8_0": 0.7}  # the Q8_0 kernel's prefill rate relative to the K-quants' (160 vs ~225)
DEFAULT_FLOAT_FLOPS_PER_THREAD = 50e9
# Fixed Python/torch cost per layer per decode step: 0.6-0.75 ms measured at the a3b shape with 2 threads
# (Zen 4); the middle is the default until the probe has run.
DEFAULT_LAYER_OVERHEAD_S = 0.65e-3
DEFAULT_TOKEN_OVERHEAD_S = 0.0
# Per layer per prompt token, what prefill costs beyond its FLOP terms (norms, RoPE, softmax over the prompt,
# activation quantization, routing and scatter/gather): the overhead probe's figure on Zen 4, 2 threads, a3b shape.
DEFAULT_PREFILL_OVERHEAD_S = 0.15e-3
DEFAULT_LAUNCH_S = 20e-6  # one kernel launch + sync on a GPU when a miss is computed at home
DEFAULT_UBATCH = 512
F32_NAMES = ("F32", "F16", "BF16")

# hardware.json sections (keyed by thread count, like bandwidth.SECTION)
SEC_KERNEL = "kernel_decode_gbps"
SEC_QFLOPS = "kernel_prefill_flops"
SEC_FLOAT = "float_flops"
SEC_OVERHEAD = "forward_overhead"


@dataclass(frozen=True)
class Figure:
    value: float
    source: str  # "measured" | "cached" | "given" | "default"


@dataclass(frozen=True)
class Rates:
    """Machine rates (module docstring). kernel_gbps / qflops: ((qtype name, Figure), ...) — qtypes not
    listed use `default_kernel_gbps` / `default_qflops`."""

    ram_gbps: Figure
    disk_gbps: Figure
    layer_overhead_s: Figure
    token_overhead_s: Figure
    default_qflops: Figure
    float_flops: Figure
    kernel_eff: Figure = Figure(DEFAULT_KERNEL_EFF, "default")
    kernel_gbps: tuple[tuple[str, Figure], ...] = ()
    moe_gbps: tuple[tuple[str, Figure], ...] = ()  # the fused MoE kernel at decode (k experts, one token)
    qflops: tuple[tuple[str, Figure], ...] = ()
    h2d_gbps: Figure | None = None
    device_gbps: Figure | None = None
    launch_s: Figure = Figure(DEFAULT_LAUNCH_S, "default")
    prefill_overhead_s: Figure = Figure(0.0, "default")  # per layer per prompt token (DEFAULT_... in gather)

    def kernel(self, qtype: str, moe: bool = False) -> float:
        """GB/s the CPU streams a tensor of `qtype` at in decode (float tensors go through torch: raw bw);
        moe: through the fused MoE kernel (routed experts), when measured."""
        for q, f in self.moe_gbps if moe else ():
            if q == qtype:
                return f.value
        for q, f in self.kernel_gbps:
            if q == qtype:
                return f.value
        if qtype in F32_NAMES:
            return self.ram_gbps.value
        return self.ram_gbps.value * self.kernel_eff.value

    def flops(self, qtype: str) -> float:
        for q, f in self.qflops:
            if q == qtype:
                return f.value
        if qtype in F32_NAMES:
            return self.float_flops.value
        return self.default_qflops.value * DEFAULT_QFLOPS_FACTOR.get(qtype, 1.0)

    def sources(self) -> dict[str, str]:
        out = {"ram_gbps": self.ram_gbps.source, "disk_gbps": self.disk_gbps.source,
               "layer_overhead_s": self.layer_overhead_s.source, "token_overhead_s": self.token_overhead_s.source,
               "float_flops": self.float_flops.source, "prefill_overhead_s": self.prefill_overhead_s.source}
        for q, f in self.kernel_gbps:
            out[f"kernel_gbps.{q}"] = f.source
        for q, f in self.moe_gbps:
            out[f"moe_gbps.{q}"] = f.source
        for q, f in self.qflops:
            out[f"qflops.{q}"] = f.source
        if not self.kernel_gbps:
            out["kernel_eff"] = self.kernel_eff.source
        if not self.qflops:
            out["qflops"] = self.default_qflops.source
        if self.h2d_gbps:
            out["h2d_gbps"] = self.h2d_gbps.source
        if self.device_gbps:
            out["device_gbps"] = self.device_gbps.source
        return out


@dataclass(frozen=True)
class Part:
    """Bytes and parameters of one group of tensors read together: same qtype, same tier, same layer."""

    layer: int | None  # None: embeddings / head / output norm
    cls: str  # tensor class (moerun.formats.names.tensor_class), "head" for output + output norm
    qtype: str
    tier: str  # where the bytes live: vram / ram / disk
    compute: str  # where it is computed: cpu / cuda:N
    nbytes: int  # bytes read per token (routed experts: all E experts' bytes, before k/E)
    params: int


@dataclass(frozen=True)
class Workload:
    n_layers: int
    n_experts: int
    n_experts_used: int
    hidden: int
    n_heads: int
    head_dim: int
    parts: tuple[Part, ...]
    hit_rate: tuple[float, ...]  # per layer, 1.0 where experts are resident / not cached
    hit_source: str  # "resident" | "uniform" | "trace" | "none"
    cpu_only: bool = True
    home: str = "ram"

    @property
    def frac(self) -> float:
        return self.n_experts_used / self.n_experts if self.n_experts else 0.0


@dataclass(frozen=True)
class DecodeTerms:
    dense: float
    experts_hit: float
    experts_miss: float
    overhead: float
    head: float
    bytes_by_class: tuple[tuple[str, int], ...] = ()
    bytes_by_tier: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> float:
        return self.dense + self.experts_hit + self.experts_miss + self.overhead + self.head

    @property
    def tok_s(self) -> float:
        return 1.0 / self.total if self.total > 0 else math.inf

    def to_dict(self) -> dict:
        return {"dense_s": self.dense, "experts_hit_s": self.experts_hit, "experts_miss_s": self.experts_miss,
                "overhead_s": self.overhead, "head_s": self.head, "total_s": self.total, "tok_s": self.tok_s,
                "bytes_by_class": dict(self.bytes_by_class), "bytes_by_tier": dict(self.bytes_by_tier)}


@dataclass(frozen=True)
class PrefillTerms:
    n_tokens: int
    compute: float
    memory: float
    overhead: float
    seconds: float  # TTFT

    @property
    def tok_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else math.inf

    def to_dict(self) -> dict:
        return {"n_tokens": self.n_tokens, "compute_s": self.compute, "memory_s": self.memory,
                "overhead_s": self.overhead, "ttft_s": self.seconds, "tok_s": self.tok_s}


# --------------------------------------------------------------------------------------- pure arithmetic


def read_rate(part: Part, rates: Rates, bound: bool) -> float:
    """GB/s at which `part` is read when it is computed where it lives (a hit, or a resident tensor)."""
    if part.compute != "cpu":
        return (rates.device_gbps or Figure(DEFAULT_DEVICE_GBPS, "default")).value
    return rates.ram_gbps.value if bound else rates.kernel(part.qtype, moe=part.cls == "routed_experts")


def miss_time(bytes_e: float, n_tokens: int, hidden: int, *, home_gbps: float, link_gbps: float,
              compute_gbps: float, launch_s: float = DEFAULT_LAUNCH_S) -> dict[str, float]:
    """Seconds for one missed expert of `bytes_e` bytes used by `n_tokens` tokens, both ways (DESIGN's min):
    fetch = page it in over the link, then compute on the device; home = compute where it lives, shipping
    2 x n x hidden float32 activations over the link (and one launch)."""
    fetch = bytes_e / (link_gbps * GB) + bytes_e / (compute_gbps * GB)
    home = bytes_e / (home_gbps * GB) + 2 * n_tokens * hidden * 4 / (link_gbps * GB) + launch_s
    return {"fetch": fetch, "home": home}


def miss_choice(bytes_e: float, n_tokens: int, hidden: int, *, home_gbps: float, link_gbps: float,
                compute_gbps: float, launch_s: float = DEFAULT_LAUNCH_S) -> str:
    """"fetch" or "home", whichever `miss_time` says is faster (ties fetch: the expert is then cached)."""
    t = miss_time(bytes_e, n_tokens, hidden, home_gbps=home_gbps, link_gbps=link_gbps,
                  compute_gbps=compute_gbps, launch_s=launch_s)
    return "fetch" if t["fetch"] <= t["home"] else "home"


def _miss_seconds(nbytes: float, part: Part, w: Workload, rates: Rates, bound: bool) -> float:
    """Seconds to serve `nbytes` of missed expert bytes of `part` (one decode token, n = 1 per expert)."""
    home = rates.disk_gbps.value if part.tier == "disk" else rates.ram_gbps.value
    if part.compute == "cpu":  # the CPU runtime reads the miss into a RAM slot, then computes from it
        return nbytes / (home * GB) + nbytes / (read_rate(part, rates, bound) * GB)
    k = max(w.n_experts_used, 1)
    t = miss_time(nbytes / k, 1, w.hidden, home_gbps=home,
                  link_gbps=(rates.h2d_gbps or Figure(DEFAULT_H2D_GBPS, "default")).value,
                  compute_gbps=read_rate(part, rates, bound), launch_s=0.0 if bound else rates.launch_s.value)
    return k * min(t.values())


def decode_time(w: Workload, rates: Rates, bound: bool = False) -> DecodeTerms:
    """The decode terms of one token (module docstring). bound=True: raw bandwidths, no overhead."""
    dense = hit = miss = head = 0.0
    by_class: dict[str, int] = {}
    by_tier: dict[str, int] = {}
    for p in w.parts:
        nbytes = p.nbytes * w.frac if p.cls == "routed_experts" else p.nbytes
        by_class[p.cls] = by_class.get(p.cls, 0) + round(nbytes)
        if p.cls == "routed_experts":
            h = w.hit_rate[p.layer] if p.layer is not None else 1.0
            t_hit = nbytes * h / (read_rate(p, rates, bound) * GB)
            hit += t_hit
            miss += _miss_seconds(nbytes * (1 - h), p, w, rates, bound) if h < 1 else 0.0
            slot_tier = "vram" if p.compute != "cpu" else "ram"
            hit_tier = slot_tier if (p.tier == "disk" or p.compute != "cpu") else p.tier
            by_tier[hit_tier] = by_tier.get(hit_tier, 0) + round(nbytes * h)
            if h < 1:
                by_tier[p.tier] = by_tier.get(p.tier, 0) + round(nbytes * (1 - h))
            continue
        by_tier[p.tier] = by_tier.get(p.tier, 0) + round(nbytes)
        t = nbytes / (read_rate(p, rates, bound) * GB)
        if p.layer is None:
            head += t
        else:
            dense += t
    overhead = 0.0 if bound else w.n_layers * rates.layer_overhead_s.value + rates.token_overhead_s.value
    return DecodeTerms(dense, hit, miss, overhead, head, tuple(sorted(by_class.items())),
                       tuple(sorted(by_tier.items())))


def prefill_time(w: Workload, rates: Rates, n_tokens: int, ubatch: int = DEFAULT_UBATCH) -> PrefillTerms:
    """Seconds to run an n-token prompt (module docstring), as PrefillTerms (TTFT = .seconds)."""
    if n_tokens <= 0:
        return PrefillTerms(0, 0.0, 0.0, 0.0, 0.0)
    compute_total = memory_total = overhead_total = seconds = 0.0
    E, k = w.n_experts, w.n_experts_used
    by_layer: dict[int, list[Part]] = {}
    for p in w.parts:
        if p.layer is not None:
            by_layer.setdefault(p.layer, []).append(p)
    done = 0
    while done < n_tokens:
        m = min(ubatch, n_tokens - done)
        touched = min(1.0, m * k / E) if E else 1.0  # share of a layer's experts the ubatch touches
        for layer in range(w.n_layers):
            comp = 4 * w.n_heads * w.head_dim * m * (done + (m + 1) / 2) / rates.float_flops.value
            mem = 0.0
            for p in by_layer.get(layer, ()):
                if p.cls == "routed_experts":
                    comp += 2 * p.params * m * w.frac / rates.flops(p.qtype)
                    rate = read_rate(p, rates, False) if p.tier != "disk" else rates.disk_gbps.value
                    mem += p.nbytes * touched / (rate * GB)
                else:
                    comp += 2 * p.params * m / rates.flops(p.qtype)
                    mem += p.nbytes / (read_rate(p, rates, False) * GB)
            compute_total += comp
            memory_total += mem
            seconds += max(comp, mem) + m * rates.prefill_overhead_s.value
            overhead_total += m * rates.prefill_overhead_s.value
        done += m
    # the head runs on the last token only (last_only=True); the embedding rows are negligible
    for p in w.parts:
        if p.layer is None:
            seconds += p.nbytes / (read_rate(p, rates, False) * GB)
    seconds += rates.token_overhead_s.value
    return PrefillTerms(n_tokens, compute_total, memory_total, overhead_total, seconds)


def prefill_tps(w: Workload, rates: Rates, n_tokens: int, ubatch: int = DEFAULT_UBATCH) -> float:
    return prefill_time(w, rates, n_tokens, ubatch).tok_s


def uniform_hit_rates(n_layers: int, n_experts: int, slots: tuple[int, ...] | list[int]) -> tuple[float, ...]:
    """slots/E per layer (uniform routing, the cache full after warm-up)."""
    return tuple(min(1.0, s / n_experts) if n_experts else 1.0 for s in list(slots)[:n_layers])


# ------------------------------------------------------------------------------- from a model and a plan


def parts_from_arch(arch, plan=None) -> tuple[Part, ...]:
    """One Part per tensor: bytes read per token (one row of an untied embedding table; all E experts of a
    routed-expert tensor, scaled by k/E later), parameters, qtype; tier and device from `plan` (None: RAM, cpu)."""
    from moerun.arch.tensors import source_shape
    from moerun.formats.names import tensor_class
    from moerun.quant.qtypes import tensor_bytes

    parts = []
    for cn, src in arch.sources.items():
        shape = source_shape(src)
        qtype = src.records[0].qtype
        nbytes = tensor_bytes(qtype, shape)
        params = math.prod(shape)
        cls = tensor_class(cn.kind)
        tp = plan.tensors.get(cn.gguf) if plan is not None else None
        tier = tp.tier if tp else "ram"
        compute = tp.device if tp else "cpu"
        if cls == "embeddings" and not arch.spec.tie_embeddings:
            nbytes, params = nbytes // shape[0], 0  # one row per token, a lookup (no FLOPs)
        elif cn.kind == "output.weight" or (cn.layer is None and cls == "norms"):
            cls = "head"
        parts.append(Part(cn.layer, cls, qtype.name, tier, compute, nbytes, params))
    return tuple(parts)


def workload(arch, plan, hit_rates: tuple[float, ...] | None = None, hit_source: str | None = None) -> Workload:
    """Per-token bytes and parameters from the resolved model and the placement plan (no weights read).

    hit_rates: per layer; None: 1.0 where the experts are resident, slots/E where a cache serves them."""
    spec = arch.spec
    parts = list(parts_from_arch(arch, plan))
    cached = {i: False for i in range(spec.n_layers)}
    slots = [0] * spec.n_layers
    for d in plan.devices:
        for i, s in zip(range(*d.layers), d.expert_slots):
            slots[i] = s
    for p in parts:
        if p.cls == "routed_experts" and p.layer is not None:
            tp_cached = p.tier == "disk" or p.compute != "cpu"
            cached[p.layer] = cached[p.layer] or tp_cached
    if hit_rates is None:
        uni = uniform_hit_rates(spec.n_layers, spec.n_experts, slots)
        hit_rates = tuple(uni[i] if cached[i] else 1.0 for i in range(spec.n_layers))
        hit_source = "uniform" if any(cached.values()) else "resident"
    else:
        hit_rates = tuple(hit_rates[i] if cached[i] else 1.0 for i in range(spec.n_layers))
    return Workload(spec.n_layers, spec.n_experts, spec.n_experts_used, spec.hidden, spec.n_heads, spec.head_dim,
                    tuple(parts), tuple(hit_rates), hit_source or "uniform",
                    cpu_only=all(d.device == "cpu" for d in plan.devices), home=plan.home)


def trace_hit_rates(trace_path: str | Path, slots: list[int] | tuple[int, ...], n_layers: int,
                    policy: str = "lru") -> tuple[float, ...]:
    """Decode hit rate per layer from replaying a routing trace against `slots` per layer (one figure: the
    trace is replayed at the smallest non-zero slot count; layers without decode steps in it get the mean)."""
    from moerun.experts.trace import read_trace, simulate

    trace = read_trace(trace_path)
    s = min((x for x in slots if x > 0), default=0)
    stats = simulate(trace, s, policy)
    overall = stats.hit_rate(phase="decode")
    if overall is None:
        overall = stats.hit_rate() or 0.0
    out = []
    for i in range(n_layers):
        h = stats.hit_rate(layer=i, phase="decode") if i in stats.layers() else None
        out.append(overall if h is None else h)
    return tuple(out)


# ------------------------------------------------------------------------------------------- the probes


def _cached(section: str, threads: int, path: Path | None = None):
    entry = bw_mod.load_cache(path).get(section, {}).get(str(threads))
    return entry if isinstance(entry, dict) else None


def _store(section: str, threads: int, entry: dict, path: Path | None = None) -> None:
    data = bw_mod.load_cache(path)
    sec = data.get(section)
    if not isinstance(sec, dict):
        sec = data[section] = {}
    old = sec.get(str(threads))
    sec[str(threads)] = {**(old if isinstance(old, dict) else {}), **entry}
    bw_mod.save_cache(data, path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_kernels(threads: int, qtypes: list[str], *, runs: int = 5) -> dict:
    """Probe the CPU kernels per qtype: decode GB/s (one token through a ~128 MiB matrix) and prefill
    FLOP/s (the fused MoE kernel, 16 experts of 768 x 2048, 32 tokens per expert), and decode GB/s through the
    fused MoE kernel. Each figure is the fastest of `runs` passes: on a shared machine other work only ever
    slows a pass down. Quantized bytes are
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
            big = QTensor.from_bytes(raw_g.reshape(I, -1).repeat(reps, 1).contiguous(), q, (I * reps, H))
            x1 = torch.randn(1, H, generator=g)
            cpu.matmul(x1, big)
            ts = []
            for _ in range(runs):
                t0 = time.perf_counter()
                cpu.matmul(x1, big)
                ts.append(time.perf_counter() - t0)
            gbps = big.data.numel() / min(ts) / GB
            del big
            ex = {e: Expert(QTensor.from_bytes(raw_g.clone(), q, (I, H)), QTensor.from_bytes(raw_g.clone(), q, (I, H)),
                            QTensor.from_bytes(raw_d.clone(), q, (H, I))) for e in range(E)}
            T = 32 * E // k
            x = torch.randn(T, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            wts = torch.full((T, k), 1.0 / k)
            cpu.moe_ffn_experts(x, ids, wts, ex)
            ts = []
            for _ in range(runs):
                t0 = time.perf_counter()
                cpu.moe_ffn_experts(x, ids, wts, ex)
                ts.append(time.perf_counter() - t0)
            flops = T * k * 3 * 2 * I * H / min(ts)
            # decode through the fused MoE kernel: one token, k of 64 distinct experts (> any L3), new ones each call
            many = {e: Expert(*(QTensor.from_bytes(r.clone(), q, s) for r, s in
                                ((raw_g, (I, H)), (raw_g, (I, H)), (raw_d, (H, I))))) for e in range(64)}
            x1 = torch.randn(1, H, generator=g)
            calls = [torch.randperm(64, generator=g)[:k].reshape(1, k) for _ in range(32)]
            w1 = torch.full((1, k), 1.0 / k)
            cpu.moe_ffn_experts(x1, calls[0], w1, many)
            ts = []
            for _ in range(runs):
                t0 = time.perf_counter()
                for ids1 in calls[1:]:
                    cpu.moe_ffn_experts(x1, ids1, w1, many)
                ts.append(time.perf_counter() - t0)
            moe_gbps = (len(calls) - 1) * k * many[0].nbytes / min(ts) / GB
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
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            torch.bmm(a, b)
            ts.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * 32 * 512 * 128 * 512 / min(ts)


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


def measure_file_read(path: str | Path, nbytes: int = 256 << 20) -> float:
    """GB/s reading up to `nbytes` of `path` with pread in 8 MiB pieces (from the middle of the file, where
    the experts are). The page cache may serve it: that is what a warm run sees."""
    size = os.path.getsize(path)
    n = min(nbytes, size)
    start = max(0, (size - n) // 2) & ~4095
    buf = bytearray(8 << 20)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < n:
            got = os.preadv(fd, [mv[: min(len(buf), n - done)]], start + done)
            if got <= 0:
                break
            done += got
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return done / dt / GB if dt > 0 else 0.0


@dataclass
class RateOptions:
    threads: int = 1
    measure: bool = False
    ram_gbps: float | None = None
    disk_gbps: float | None = None
    model_path: str | None = None
    qtypes: list[str] = field(default_factory=list)
    gpu: object | None = None  # moerun.placement.devices.GPU of the first compute device, if any
    shape: dict | None = None  # probe_shape(spec) of the model: the overhead figures are kept per shape


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
    elif opt.measure and opt.model_path:
        disk = Figure(measure_file_read(opt.model_path), "measured")
    else:
        disk = Figure(DEFAULT_DISK_GBPS, "default")

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
    return replace(rates, h2d_gbps=h2d, device_gbps=dev)
