"""A device stage (a GPU, or the CPU stand-in; moerun.device): its dense weights and KV on the device, its
routed experts at home (pinned host RAM, or the file) behind an expert cache whose slots are device buffers,
and per miss the cost model's choice between paging in and computing on the CPU (moerun.model.offload).

Per layer, from the plan: experts that all fit in the stage's slots are held on the device (no cache);
experts the plan keeps on the CPU (--n-cpu-moe, -ot ...exps=CPU) are computed there, never paged; the
others are served by the cache.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from moerun import device
from moerun.config import RuntimeConfig
from moerun.engine.pipeline import Stage
from moerun.experts.cache import ExpertCache
from moerun.experts.store import Expert, ExpertStore
from moerun.model.gpu_ops import device_ops
from moerun.model.offload import DeviceExperts
from moerun.model.ops import make_ops
from moerun.placement import costmodel as cm
from moerun.placement.planner import DevicePlan, Plan
from moerun.quant.qtypes import QTensor


def _cached_layer(the_plan: Plan, layer: int) -> bool:
    """Whether the plan serves the layer's routed experts through its device's cache (not pinned to the CPU)."""
    exps = [t for name, t in the_plan.tensors.items() if name.startswith(f"blk.{layer}.") and "_exps" in name]
    return bool(exps) and all(t.cached for t in exps)


def _on_device(store: ExpertStore, layer: int, dev: device.Device) -> dict[int, Expert]:
    """Every expert of `layer` copied to the device (its stacks moved, one expert a view of each)."""
    g, u, d = (QTensor(device.to_device(q.data, dev), q.qtype, q.shape) for q in store.stacks(layer) or
               _stacked(store, layer))
    return {e: Expert(g[e], u[e], d[e]) for e in range(store.n_experts(layer))}


def _stacked(store: ExpertStore, layer: int) -> tuple[QTensor, QTensor, QTensor]:
    """An owned store's experts of a layer as (gate, up, down) stacks (a copy)."""
    import torch

    like = store.get(layer, 0)
    out = []
    for name in ("gate", "up", "down"):
        q = getattr(like, name)
        data = torch.stack([getattr(store.get(layer, e), name).data for e in range(store.n_experts(layer))])
        out.append(QTensor(data, q.qtype, (store.n_experts(layer), *q.shape)))
    return tuple(out)


def stage_rates(cfg: RuntimeConfig, dev: device.Device, arch, threads: int) -> cm.Rates:
    """The cost model's figures for this machine and device: given, cached probes, NVML's, measured, defaults."""
    from moerun.placement import probes
    from moerun.placement.devices import detect, standin_gpu

    gpu = standin_gpu(dev.index) if dev.kind == "standin" else next(
        (g for g in detect().gpus if g.index == dev.index), None)
    qtypes = sorted({src.records[0].qtype.name for src in arch.sources.values()})
    rates = probes.gather_rates(probes.RateOptions(threads=threads, qtypes=qtypes, gpu=gpu or standin_gpu(0),
                                                   h2d_gbps=cfg.h2d_gbps, vram_gbps=cfg.vram_gbps))
    measured = None if cfg.h2d_gbps else device.measure_h2d_gbps(dev)
    if measured:
        rates = replace(rates, h2d_gbps=cm.Figure(measured, "measured"))
    if dev.kind == "standin":  # its "device" is this host: the CPU's figures, a copy through RAM for its link
        ram, src = rates.ram_gbps.value, "stand-in"
        rates = replace(rates, h2d_gbps=rates.h2d_gbps if cfg.h2d_gbps else cm.Figure(ram / 2, src),
                        device_gbps=rates.device_gbps if cfg.vram_gbps else cm.Figure(ram * rates.kernel_eff.value, src),
                        device_flops=cm.Figure(rates.default_qflops.value, src),
                        device_layer_overhead_s=rates.layer_overhead_s)
    return rates


def device_stage(cfg: RuntimeConfig, model, dp: DevicePlan, the_plan: Plan, arch) -> Stage:
    """Place `model` (the stage's MoEModel) on dp's device and give it its experts (module docstring)."""
    dev = device.parse(dp.device)
    kernels = model.ops.name != "reference"
    model.place(dev, device_ops(dev, kernels))
    slots = dict(zip(range(*dp.layers), dp.expert_slots))
    model.experts, cache = device_experts(cfg, dev, model.ops, kernels, model.store, slots,
                                          home_layers(the_plan, model.store), arch)
    return Stage(model, cache)


def home_layers(the_plan: Plan, store: ExpertStore) -> set[int]:
    """The layers of `store` whose experts the plan keeps on the CPU (--n-cpu-moe, -ot ...exps=CPU)."""
    return {layer for layer in store.layers if not _cached_layer(the_plan, layer)}


def device_experts(cfg: RuntimeConfig, dev: device.Device, ops, kernels: bool, store: ExpertStore,
                   slots: dict[int, int], home: set[int], arch) -> tuple[DeviceExperts, ExpertCache | None]:
    """`store`'s experts computed on `dev` by `ops` (gpu_ops.device_ops; the CPU kernels for misses computed at
    home) -> (their DeviceExperts, the cache on the device or None): layers with slots for every expert held
    there, `home` layers on the CPU, the others paged."""
    import psutil

    resident = {layer: _on_device(store, layer, dev) for layer in store.layers
                if layer not in home and slots.get(layer, 0) >= store.n_experts(layer)}
    paged = [layer for layer in store.layers if layer not in home and layer not in resident]
    pinned, pinned_layers = [], set()
    if store.reader is None:  # the experts are in RAM moerun owns: page-lock them for async copies
        for layer in paged:
            regions = [device.pin(q.data, dev) for q in store.stacks(layer) or ()]
            pinned += regions
            if regions and all(r.pinned for r in regions):
                pinned_layers.add(layer)
    cache = None
    if paged:
        cache = ExpertCache(store, slots={layer: slots.get(layer, 0) for layer in paged}, policy=cfg.cache_policy,
                            device=dev, prefill=cfg.cache_prefill, pinned_layers=pinned_layers)
    rates = stage_rates(cfg, dev, arch, cfg.threads or psutil.cpu_count(logical=False) or 1)
    tier = "disk" if store.reader is not None else "ram"
    spec = arch.spec
    costs = {layer: cm.miss_costs(rates, store.get(layer, 0).gate.qtype.name, tier, spec.hidden, spec.n_experts_used)
             for layer in paged}
    params_e = 3 * spec.hidden * spec.expert_ffn

    @functools.lru_cache(maxsize=4096)
    def choose(layer: int, e: int, n: int) -> str:
        if cfg.miss_path != "auto":
            return cfg.miss_path
        return costs[layer].choose(store.expert_bytes(layer), params_e, n)

    experts = DeviceExperts(dev, ops, make_ops(kernels), store, cache,
                            lambda layer, e, n: choose(layer, 0, n), resident, home, pinned)
    return experts, cache
