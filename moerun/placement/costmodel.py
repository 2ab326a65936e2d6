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
- qflops        per qtype: FLOP/s of the CPU kernels in prefill (the fused MoE kernel, 32 tokens per
                expert); measured, else `DEFAULT_QFLOPS_PER_THREAD` x threads.
- float_flops   FLOP/s of torch float32 batched matmuls (attention scores over the prompt in prefill).
- layer_overhead_s  seconds per layer per decode step that the byte terms do not explain (attention's
                arithmetic, norms, RoPE, routing, Python between kernel calls, the experts' rate beyond the
                matmul probe's): the layer probe (`moerun.placement.layer_probe`) decodes on in-memory models
                of one and three of this model's own layers, and this is the slope of what is left over.
- token_overhead_s  seconds per decode step outside the layers (embedding lookup, head, sampling): the
                intercept of the same probe.
- prefill_overhead_s  seconds per layer per prompt token that prefill costs beyond its FLOP terms, from
                the same probe running a prompt with as many tokens per expert as 512 tokens have.

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

A linear-attention layer's tensors are dense like attention's; besides them a token reads its sequence's
recurrent state once and writes it once (2 x its float32 bytes, "recurrent_state", in `dense`, read where the
layer computes).

A decode step of B sequences together (`batch`, the server's continuous batching) reads every dense tensor
once and, per MoE layer, the union of the B tokens' experts: under independent routing a share
1 - (1 - k/E)^B of the layer's experts instead of k/E, and B sequences' recurrent states; tok/s = B / (the
step's sum).

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
              or, in a linear layer, m x state_flops() / float_flops   (the chunked delta rule)
      memory  = dense bytes / rate + bytes of the experts touched (min(E, m k) of E) / rate(home)
      time    = max(compute, memory) + m x prefill_overhead_s
    pp tok/s = n / (sum over ubatches and layers + head on the last token);  TTFT = that time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

GB = 1e9

# ---------------------------------------------------------------------------------------------- defaults
# Used when nothing has been measured; each is labelled "default" wherever it is printed.
DEFAULT_DISK_GBPS = 2.0  # one NVMe SSD, sequential reads (a SATA SSD is ~0.5, the page cache ~10)
DEFAULT_H2D_GBPS = 12.0  # PCIe 4.0 x16 pageable copies, when NVML gives no link figure
DEFAULT_DEVICE_GBPS = 500.0  # a mid-range GPU, when NVML/torch gives no memory figure
DEFAULT_DEVICE_FLOPS = 20e12  # the Triton kernels' float32 products on a consumer GPU, dequantizing as they go
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
# Fixed cost per layer per step on a GPU stage: ~20 kernel launches from Python and, where experts are not
# all on the GPU, the one wait for the router's choices. Not measured yet (no GPU run): a guess to check.
DEFAULT_DEVICE_LAYER_OVERHEAD_S = 0.15e-3
DEFAULT_UBATCH = 512
F32_NAMES = ("F32", "F16", "BF16")
STATE_CLASS = "recurrent_state"  # a linear layer's state, read and written once per token (Part.cls)
DELTA_CHUNK = 64  # tokens per chunk of the chunked delta rule (prefill)

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
    qflops: tuple[tuple[str, Figure], ...] = ()
    h2d_gbps: Figure | None = None
    device_gbps: Figure | None = None
    device_flops: Figure | None = None
    launch_s: Figure = Figure(DEFAULT_LAUNCH_S, "default")
    prefill_overhead_s: Figure = Figure(0.0, "default")  # per layer per prompt token (DEFAULT_... in gather)
    device_layer_overhead_s: Figure = Figure(DEFAULT_DEVICE_LAYER_OVERHEAD_S, "default")  # a GPU stage's layer

    def device_flops_value(self) -> float:
        return (self.device_flops or Figure(DEFAULT_DEVICE_FLOPS, "default")).value

    def kernel(self, qtype: str) -> float:
        """GB/s the CPU streams a tensor of `qtype` at in decode (float tensors go through torch: raw bw)."""
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
    linear: tuple[bool, ...] = ()  # per layer: linear attention (gated DeltaNet); () none
    state_flops: float = 0.0  # FLOPs per prompt token of one linear layer's recurrence (state_flops())

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
    bytes_by_class: tuple[tuple[str, int], ...] = ()  # per step
    bytes_by_tier: tuple[tuple[str, int], ...] = ()
    batch: int = 1  # tokens per step

    @property
    def total(self) -> float:
        return self.dense + self.experts_hit + self.experts_miss + self.overhead + self.head

    @property
    def tok_s(self) -> float:
        return self.batch / self.total if self.total > 0 else math.inf

    def to_dict(self) -> dict:
        return {"dense_s": self.dense, "experts_hit_s": self.experts_hit, "experts_miss_s": self.experts_miss,
                "overhead_s": self.overhead, "head_s": self.head, "total_s": self.total, "tok_s": self.tok_s,
                "batch": self.batch, "bytes_by_class": dict(self.bytes_by_class),
                "bytes_by_tier": dict(self.bytes_by_tier)}


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
    return rates.ram_gbps.value if bound else rates.kernel(part.qtype)


def miss_time(bytes_e: float, n_tokens: int, hidden: int, *, home_gbps: float, link_gbps: float,
              compute_gbps: float, launch_s: float = DEFAULT_LAUNCH_S, params_e: float = 0.0,
              home_flops: float = math.inf, device_flops: float = math.inf) -> dict[str, float]:
    """Seconds for one missed expert of `bytes_e` bytes (`params_e` weights) used by `n_tokens` tokens, both
    ways (DESIGN's min): fetch = page it in over the link, then compute on the device; home = compute where it
    lives, shipping 2 x n x hidden float32 activations over the link (and one launch). Each computation takes
    the longer of reading the bytes and doing its 2 x params x n FLOPs: decode is bandwidth-bound, a prompt
    chunk with many tokens per expert FLOP-bound, and that is where fetching starts to pay."""
    flops = 2 * params_e * n_tokens
    fetch = bytes_e / (link_gbps * GB) + max(bytes_e / (compute_gbps * GB), flops / device_flops)
    home = max(bytes_e / (home_gbps * GB), flops / home_flops) + 2 * n_tokens * hidden * 4 / (link_gbps * GB) \
        + launch_s
    return {"fetch": fetch, "home": home}


def miss_choice(bytes_e: float, n_tokens: int, hidden: int, *, home_gbps: float, link_gbps: float,
                compute_gbps: float, launch_s: float = DEFAULT_LAUNCH_S, params_e: float = 0.0,
                home_flops: float = math.inf, device_flops: float = math.inf) -> str:
    """"fetch" or "home", whichever `miss_time` says is faster (ties fetch: the expert is then cached)."""
    t = miss_time(bytes_e, n_tokens, hidden, home_gbps=home_gbps, link_gbps=link_gbps, compute_gbps=compute_gbps,
                  launch_s=launch_s, params_e=params_e, home_flops=home_flops, device_flops=device_flops)
    return "fetch" if t["fetch"] <= t["home"] else "home"


@dataclass(frozen=True)
class MissCosts:
    """The rates a device stage's miss path weighs (`miss_choice`), for one layer's experts: the CPU kernels
    where the experts live (home), the host-to-device link, the device. Built by `miss_costs`."""

    hidden: int
    home_gbps: float
    home_flops: float
    link_gbps: float
    device_gbps: float
    device_flops: float
    launch_s: float  # one home computation per layer and step (a C call, the rows' upload)
    n_used: int = 1  # experts per token: the launch is shared by a step's home misses

    def choose(self, bytes_e: int, params_e: int, n_tokens: int) -> str:
        return miss_choice(bytes_e, n_tokens, self.hidden, home_gbps=self.home_gbps, link_gbps=self.link_gbps,
                           compute_gbps=self.device_gbps, launch_s=self.launch_s / max(self.n_used, 1),
                           params_e=params_e, home_flops=self.home_flops, device_flops=self.device_flops)


def miss_costs(rates: Rates, qtype: str, home_tier: str, hidden: int, n_used: int = 1) -> MissCosts:
    """MissCosts from the machine's rates for experts of `qtype` whose home is "ram" or "disk" (the file: both
    ways then read it first)."""
    disk = rates.disk_gbps.value if home_tier == "disk" else math.inf
    link = (rates.h2d_gbps or Figure(DEFAULT_H2D_GBPS, "default")).value
    return MissCosts(hidden=hidden, home_gbps=min(rates.kernel(qtype), disk),
                     home_flops=rates.flops(qtype), link_gbps=min(link, disk),
                     device_gbps=(rates.device_gbps or Figure(DEFAULT_DEVICE_GBPS, "default")).value,
                     device_flops=(rates.device_flops or Figure(DEFAULT_DEVICE_FLOPS, "default")).value,
                     launch_s=rates.launch_s.value, n_used=n_used)


def _miss_seconds(nbytes: float, part: Part, w: Workload, rates: Rates, bound: bool) -> float:
    """Seconds to serve `nbytes` of missed expert bytes of `part` (one decode token, n = 1 per expert)."""
    home = rates.disk_gbps.value if part.tier == "disk" else rates.ram_gbps.value
    if part.compute == "cpu":  # the CPU runtime reads the miss into a RAM slot, then computes from it
        return nbytes / (home * GB) + nbytes / (read_rate(part, rates, bound) * GB)
    k = max(w.n_experts_used, 1)
    home_rate = home if bound or part.tier == "disk" else rates.kernel(part.qtype)  # the CPU computes it
    # one of an expert's three tensors: a third of the launch a layer's home misses share (MissCosts.choose)
    launch = 0.0 if bound else rates.launch_s.value / (3 * k)
    t = miss_time(nbytes / k, 1, w.hidden, home_gbps=home_rate,
                  link_gbps=(rates.h2d_gbps or Figure(DEFAULT_H2D_GBPS, "default")).value,
                  compute_gbps=read_rate(part, rates, bound), launch_s=launch)
    return k * min(t.values())


def expert_share(frac: float, batch: int) -> float:
    """Expected share of a layer's experts that `batch` independently routed tokens use, k/E each."""
    return 1.0 - (1.0 - frac) ** batch


def decode_time(w: Workload, rates: Rates, bound: bool = False, batch: int = 1) -> DecodeTerms:
    """The decode terms of one step of `batch` tokens (module docstring). bound=True: raw bandwidths, no
    overhead."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    share = expert_share(w.frac, batch)
    dense = hit = miss = head = 0.0
    by_class: dict[str, int] = {}
    by_tier: dict[str, int] = {}
    for p in w.parts:
        # one embedding row and one recurrent state a token
        nbytes = p.nbytes * {"routed_experts": share, "embeddings": batch, STATE_CLASS: batch}.get(p.cls, 1)
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
    overhead = 0.0 if bound else sum(_layer_overhead(w, rates, i) for i in range(w.n_layers)) + \
        rates.token_overhead_s.value
    return DecodeTerms(dense, hit, miss, overhead, head, tuple(sorted(by_class.items())),
                       tuple(sorted(by_tier.items())), batch)


def _layer_overhead(w: Workload, rates: Rates, layer: int) -> float:
    """Fixed seconds per step of one layer: a GPU stage's (launches, the ids' wait) or the CPU's."""
    on_device = any(p.layer == layer and p.compute != "cpu" and p.cls != "routed_experts" for p in w.parts)
    return (rates.device_layer_overhead_s if on_device else rates.layer_overhead_s).value


def _flops(p: Part, rates: Rates) -> float:
    """FLOP/s at which `p` is multiplied where it is computed."""
    return rates.device_flops_value() if p.compute != "cpu" else rates.flops(p.qtype)


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
            parts = by_layer.get(layer, ())
            dense_dev = any(p.compute != "cpu" and p.cls != "routed_experts" for p in parts)
            mixer = m * w.state_flops if w.linear and w.linear[layer] else \
                4 * w.n_heads * w.head_dim * m * (done + (m + 1) / 2)
            comp = mixer / (rates.device_flops_value() if dense_dev else rates.float_flops.value)
            mem = offloaded = 0.0
            for p in parts:
                if p.cls == "routed_experts" and p.compute != "cpu":  # a device stage's cache: hits and misses
                    offloaded += _offloaded_prefill(p, w, rates, m)
                elif p.cls == "routed_experts":
                    comp += 2 * p.params * m * w.frac / rates.flops(p.qtype)
                    rate = read_rate(p, rates, False) if p.tier != "disk" else rates.disk_gbps.value
                    mem += p.nbytes * touched / (rate * GB)
                else:
                    comp += 2 * p.params * m / _flops(p, rates)
                    mem += p.nbytes / (read_rate(p, rates, False) * GB)
            compute_total += comp
            memory_total += mem
            per_token = 0.0 if dense_dev else rates.prefill_overhead_s.value
            seconds += max(comp, mem) + offloaded + m * per_token + (rates.device_layer_overhead_s.value
                                                                     if dense_dev else 0.0)
            overhead_total += m * per_token
        done += m
    # the head runs on the last token only (last_only=True); the embedding rows are negligible
    for p in w.parts:
        if p.layer is None:
            seconds += p.nbytes / (read_rate(p, rates, False) * GB)
    seconds += rates.token_overhead_s.value
    return PrefillTerms(n_tokens, compute_total, memory_total, overhead_total, seconds)


def _offloaded_prefill(p: Part, w: Workload, rates: Rates, m: int) -> float:
    """Seconds a device stage spends on one routed-expert tensor's share for a chunk of m tokens: the experts
    the chunk touches (expected distinct: E (1 - (1 - k/E)^m)), each with m k / E tokens; hits from the
    slots, misses as the miss path serves them (`miss_time`: streamed over the link or computed at home)."""
    E, h = w.n_experts, w.hit_rate[p.layer]
    touched = E * expert_share(w.frac, m)
    n = max(1.0, m * w.n_experts_used / max(touched, 1.0))
    b, params = p.nbytes / E, p.params / E
    hit = max(b / (read_rate(p, rates, False) * GB), 2 * params * n / rates.device_flops_value())
    home = rates.disk_gbps.value if p.tier == "disk" else rates.kernel(p.qtype)
    t = miss_time(b, round(n), w.hidden, home_gbps=home,
                  link_gbps=(rates.h2d_gbps or Figure(DEFAULT_H2D_GBPS, "default")).value,
                  compute_gbps=read_rate(p, rates, False), launch_s=rates.launch_s.value, params_e=params,
                  home_flops=rates.flops(p.qtype), device_flops=rates.device_flops_value())
    return touched * (h * hit + (1 - h) * min(t.values()))


def prefill_tps(w: Workload, rates: Rates, n_tokens: int, ubatch: int = DEFAULT_UBATCH) -> float:
    return prefill_time(w, rates, n_tokens, ubatch).tok_s


def uniform_hit_rates(n_layers: int, n_experts: int, slots: tuple[int, ...] | list[int]) -> tuple[float, ...]:
    """slots/E per layer (uniform routing, the cache full after warm-up)."""
    return tuple(min(1.0, s / n_experts) if n_experts else 1.0 for s in list(slots)[:n_layers])


# ------------------------------------------------------------------------------- from a model and a plan


def parts_from_arch(arch, plan=None) -> tuple[Part, ...]:
    """One Part per tensor of the resolved model (parts_from_tensors); tier and device from `plan` (None: RAM,
    cpu)."""
    from moerun.arch.tensors import source_shape

    return parts_from_tensors(arch.spec, ((cn, src.records[0].qtype, source_shape(src))
                                          for cn, src in arch.sources.items()), plan)


def parts_from_tensors(spec, tensors, plan=None) -> tuple[Part, ...]:
    """One Part per (canonical name, qtype, shape) in `tensors`: bytes read per token (one row of an untied
    embedding table; all E experts of a routed-expert tensor, scaled by k/E later), parameters, qtype; tier
    and device from `plan` (None: RAM, cpu)."""
    from moerun.formats.names import tensor_class
    from moerun.quant.ggml_types import tensor_bytes

    parts = []
    for cn, qtype, shape in tensors:
        nbytes = tensor_bytes(qtype, shape)
        params = math.prod(shape)
        cls = tensor_class(cn.kind)
        tp = plan.tensors.get(cn.gguf) if plan is not None else None
        tier = tp.tier if tp else "ram"
        compute = tp.device if tp else "cpu"
        if cls == "embeddings" and not spec.tie_embeddings:
            nbytes, params = nbytes // shape[0], 0  # one row per token, a lookup (no FLOPs)
        elif cn.kind == "output.weight" or (cn.layer is None and cls == "norms"):
            cls = "head"
        parts.append(Part(cn.layer, cls, qtype.name, tier, compute, nbytes, params))
    return tuple(parts)


def state_parts(spec, plan=None) -> tuple[Part, ...]:
    """One Part per linear layer: its recurrent state read and written once per token (2 x float32 bytes),
    where the layer computes (`plan`; None: cpu)."""
    parts = []
    for i in range(spec.n_layers):
        st = spec.state_layout(i)
        if st is None:
            continue
        dev = plan.layer_device(i) if plan is not None else "cpu"
        tier = "ram" if dev == "cpu" else "vram"
        parts.append(Part(i, STATE_CLASS, "F32", tier, dev, 2 * 4 * st.elems(), 0))
    return tuple(parts)


def state_flops(spec) -> float:
    """FLOPs per token of one linear layer's chunked delta rule, per value head: q S, k S and the state update
    (3 x 2 dk dv), and within a chunk of DELTA_CHUNK tokens q k^T, k k^T (2 x 2 C dk) and the scores times v
    (2 C dv); the conv1d (2 x channels x kernel)."""
    dk, dv, c = spec.ssm_k_dim, spec.ssm_v_dim, DELTA_CHUNK
    return spec.ssm_v_heads * (6 * dk * dv + 4 * c * dk + 2 * c * dv) + 2 * spec.ssm_conv_dim * spec.ssm_conv


def workload(arch, plan, hit_rates: tuple[float, ...] | None = None, hit_source: str | None = None) -> Workload:
    """Per-token bytes and parameters from the resolved model and the placement plan (no weights read); the
    linear layers' recurrent state (state_parts).

    hit_rates: per layer; None: 1.0 where the experts are resident, slots/E where a cache serves them."""
    spec = arch.spec
    parts = list(parts_from_arch(arch, plan)) + list(state_parts(spec, plan))
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
                    cpu_only=all(d.device == "cpu" for d in plan.devices), home=plan.home,
                    linear=tuple(spec.linear(i) for i in range(spec.n_layers)) if spec.hybrid else (),
                    state_flops=state_flops(spec) if spec.hybrid else 0.0)


def trace_hit_rates(trace_path: str | Path, slots: list[int] | tuple[int, ...], n_layers: int,
                    policy: str = "lru", prefill: bool = False) -> tuple[float, ...]:
    """Decode hit rate per layer from replaying a routing trace, each layer at its own slot count (`slots[i]`;
    a layer without slots is not cached: 0). Layers without decode steps in the trace get the mean of those that
    have them at the same slot count. The prompts' steps are replayed only with `prefill` (a cache that pages
    prefill misses in); by default, as the runtime's cache does, they bypass it."""
    from moerun.experts.trace import read_trace, simulate

    trace = read_trace(trace_path)
    if not prefill:
        trace = [r for r in trace.records if r.phase == "decode"]
    by_slots = {s: simulate(trace, s, policy) for s in sorted(set(slots[:n_layers])) if s > 0}
    out = []
    for i in range(n_layers):
        s = slots[i] if i < len(slots) else 0
        if s <= 0:
            out.append(0.0)
            continue
        stats = by_slots[s]
        h = stats.hit_rate(layer=i, phase="decode") if i in stats.layers() else None
        if h is None:
            h = stats.hit_rate(phase="decode")
        out.append(stats.hit_rate() or 0.0 if h is None else h)
    return tuple(out)
