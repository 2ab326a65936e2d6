"""From a RuntimeConfig to a running engine: plan the placement, load per the plan, attach the expert cache.

formats -> arch (metadata only) -> placement (pure plan) -> weights (loaded per plan) -> experts (cache)
-> engine. The plan is returned too, so the CLI can print it.

Each device of the plan is a stage (a layer range with its own expert cache). Several stages in one process
run through a StagedModel; with pipeline_world_size > 1 each process is one stage (moerun.distributed):
`build` is rank 0's (it owns the engine), `serve_worker` every other rank's.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import torch

from moerun import device
from moerun.arch import resolve
from moerun.builtin import DEFAULT_MODEL, default_model_path, model_path  # noqa: F401 (re-exported)
from moerun.config import RuntimeConfig
from moerun.engine.engine import Engine
from moerun.engine.kv_types import kv_type
from moerun.engine.pipeline import Stage, StageCaches, StagedModel
from moerun.errors import MoerunError
from moerun.experts.cache import ExpertCache
from moerun.experts.stats import CacheStats
from moerun.formats import ModelFile, open_model
from moerun.formats.names import tensor_class
from moerun.hostmem import Arena
from moerun.loading import load_model
from moerun.model.moe import CachedExperts, ResidentExperts
from moerun.model.ops import set_threads
from moerun.placement.devices import detect, with_devices
from moerun.placement.planner import Budgets, Plan, plan
from moerun.runtime_device import device_stage
from moerun.text import Tokenizer
from moerun.weights.preload import Preload

MiB = 2**20


@dataclass
class Runtime:
    engine: Engine
    plan: Plan
    cache: ExpertCache | StageCaches | None
    warnings: list[str]
    stages: list[Stage] = field(default_factory=list)  # this process's
    pipeline: object | None = None  # rank 0's moerun.distributed.PipelineModel when the stages span processes

    def stage_stats(self, reset: bool = False) -> list[tuple[str, CacheStats]]:
        """(label, a copy of its expert-cache statistics) for every stage with a cache, in layer order; their
        sum is the total. reset: every stage starts counting afresh."""
        out = []
        for k, st in enumerate(self.stages):
            if st.cache is not None:
                st.cache.settle()  # a device stage's copy and stall times, from its finished events
                out.append((st.name or f"stage {k} ({st.label})", st.cache.stats + CacheStats()))
                if reset:
                    st.cache.stats.reset()
        if self.pipeline is not None:
            out = [(self.stages[0].name or f"rank 0 ({self.stages[0].label})", s) for _, s in out]
            for r, stats in enumerate(self.pipeline.remote_stats(reset), 1):
                if stats is not None:
                    out.append((self.pipeline.rank_label(r, self.plan), stats))
        return out

    def close(self) -> None:
        """Stop the pipeline's other ranks, if any, and the expert caches' workers."""
        if self.pipeline is not None:
            self.pipeline.close()
        if self.cache is not None:
            self.cache.close()


def _cache_slots(cfg: RuntimeConfig, the_plan: Plan, store, warnings: list[str],
                 rank: int | None = None) -> dict[int, int] | None:
    """Slots per layer: the plan's (what --print-plan shows) when a cache is asked for or the experts live on
    disk, else no cache. rank: under expert parallelism, that rank's (sized for its shard)."""
    if not cfg.cache_requested and the_plan.home != "disk":
        return None
    slots = {layer: dp.expert_slots[layer - dp.layers[0]] for dp in the_plan.devices for layer in range(*dp.layers)}
    if rank is not None and the_plan.rank(rank) is not None:
        slots = dict(enumerate(the_plan.rank(rank).expert_slots))
    if cfg.expert_cache_plan is not None:  # slots per layer from a trace (moerun trace simulate --write-plan)
        from moerun.experts.allocate import read_plan

        given = read_plan(cfg.expert_cache_plan)
        moe = set(store.layers)
        extra = sorted(set(given) - moe)
        if extra:
            raise MoerunError(f"{cfg.expert_cache_plan}: layers {extra} have no routed experts in this model")
        n = max((store.n_experts(layer) for layer in moe), default=0)
        if any(v > n for v in given.values()):
            raise MoerunError(f"{cfg.expert_cache_plan}: more slots than the {n} experts of a layer")
        slots = {layer: given.get(layer, 0) for layer in slots}
    if cfg.expert_cache_mib is not None and not any(slots.values()):
        one = sum(store.expert_bytes(layer) for layer in store.layers)
        warnings.append(f"--expert-cache-mib {cfg.expert_cache_mib:g} gives no expert cache (0 slots): one slot in "
                        f"each of the {len(store.layers)} MoE layers takes {one / MiB:.2f} MiB; every expert is "
                        "read from its home tier")
    return slots


def _reshare(the_plan: Plan, cfg: RuntimeConfig, n_experts: int) -> Plan:
    """The plan with each device's expert slots re-shared over its layers by the trace's per-layer hit curves
    (--expert-cache-trace): the same total per device, so --print-plan, the CPU and the device caches agree."""
    from moerun.experts.allocate import plan_from_trace

    slots = {layer: dp.expert_slots[layer - dp.layers[0]] for dp in the_plan.devices for layer in range(*dp.layers)}
    shared = plan_from_trace(cfg.expert_cache_trace, slots, n_experts, cfg.cache_policy,
                             groups=[range(*dp.layers) for dp in the_plan.devices],
                             prefill=cfg.cache_prefill == "cache")
    devices = tuple(replace(dp, expert_slots=tuple(shared[layer] for layer in range(*dp.layers)))
                    for dp in the_plan.devices)
    return replace(the_plan, devices=devices)


def make_stage(cfg: RuntimeConfig, model, slots: dict[int, int] | None) -> Stage:
    """A CPU stage of `model` (one MoEModel of the stage's layers): its own expert cache over its layers'
    experts when slots are given, else every expert read where it is stored."""
    model.experts, cache = cpu_experts(cfg, model.store, slots, model.ops.name != "reference")
    return Stage(model, cache)


def cpu_experts(cfg: RuntimeConfig, store, slots: dict[int, int] | None, kernels: bool, prefetch: bool = True):
    """-> (the expert source of `store`'s experts on the CPU, its cache or None): a cache of `slots` per layer,
    or (None) every expert read where it is stored."""
    if slots is None:
        return ResidentExperts(store), None
    mine = {layer: slots.get(layer, 0) for layer in store.layers}
    cache = ExpertCache(store, slots=mine, policy=cfg.cache_policy, device="cpu", prefill=cfg.cache_prefill,
                        prefetch=cfg.prefetch and prefetch, interleave=cfg.repack and kernels)
    return CachedExperts(cache), cache


def _stage_models(model, the_plan: Plan) -> list:
    """One MoEModel per stage of the plan, sharing `model`'s weights (the model itself for a single stage)."""
    if len(the_plan.devices) == 1:
        return [model]
    return [model.slice(*dp.layers) for dp in the_plan.devices]


def _prepare(cfg: RuntimeConfig, held: int = 0, mf: ModelFile | None = None) -> tuple[ModelFile, int, Plan, str]:
    """-> (the opened model, context size, plan, home of the routed experts). The model file is parsed once: its
    metadata and tensor sizes plan the placement, and build() loads the weights from the same ModelFile (a
    250k-token vocabulary took 0.23 s to parse; callers that load nothing close it). held: bytes this process already
    holds for the weights (an arena's faulted pages), available to the plan as they are to the load. mf: the model
    already opened (a Preload's)."""
    set_threads(cfg.threads or psutil.cpu_count(logical=False) or 1)  # torch's and the kernels' pools
    mf = mf or open_model(model_path(cfg.model))
    try:
        return _plan_opened(cfg, mf, held)
    except BaseException:
        mf.close()
        raise


def _plan_opened(cfg: RuntimeConfig, mf: ModelFile, held: int = 0) -> tuple[ModelFile, int, Plan, str]:
    arch = resolve(mf)
    ctx = cfg.ctx_size or min(4096, arch.spec.context_length)
    vram = cfg.vram_budget[0] if cfg.vram_budget and len(cfg.vram_budget) == 1 else cfg.vram_budget
    ep = cfg.expert_parallel > 1
    devices = cfg.ep_devices if ep else cfg.stage_devices  # under EP every rank's device is budgeted
    accel = [device.parse(d) for d in devices if d != "cpu"]
    if not accel:
        vram = None  # no GPU to budget (build() warns)
    for dev in accel:
        device.check(dev)  # a GPU that is not there: one line, before anything is loaded
    budgets = Budgets(devices=devices, tensor_split=None if ep else cfg.tensor_split, ram=cfg.ram_budget,
                      vram=vram,
                      ctx_size=ctx, ubatch=cfg.ubatch, kv_contexts=cfg.kv_contexts,
                      n_cpu_moe=cfg.n_cpu_moe, override_tensor=cfg.override_tensor,
                      kv_dtype_bytes=kv_value_bytes(cfg.cache_type_k, cfg.dtype),
                      kv_v_bytes=kv_value_bytes(cfg.cache_type_v, cfg.dtype),
                      cache_slots=cfg.expert_cache_slots,
                      cache_mib=cfg.expert_cache_mib)
    inventory = detect(gpus=any(d.is_cuda for d in accel))
    if held:
        inventory = replace(inventory, ram_available=inventory.ram_available + held)
    if accel:
        inventory = with_devices(inventory, devices)
    if ep:  # each rank planned for its shard, against its own memory (moerun.placement.ep_plan)
        from moerun.expert_parallel import expert_split
        from moerun.placement.ep_plan import plan_ranks

        the_plan = plan_ranks(arch, inventory, budgets, expert_split(cfg, arch.spec), devices,
                              None if cfg.ep_world_size == 1 else cfg.ep_rank)
    else:
        the_plan = plan(arch, inventory, budgets)
    if cfg.expert_cache_trace is not None and not ep:
        the_plan = _reshare(the_plan, cfg, arch.spec.n_experts)
    if cfg.mmap is not None:
        home = "mmap" if cfg.mmap else "ram"
    elif accel:  # a device stage's experts stay in RAM (pinned) when it fits; its cache is on the device
        held = [(s, arch.spec.n_experts) for d in the_plan.devices
                for s, i in zip(d.expert_slots, range(*d.layers)) if arch.spec.moe_layers[i]]
        if the_plan.ranks:
            held = [(s, n) for r in the_plan.ranks for s, n in zip(r.expert_slots, r.owned) if n]
        # experts that all go to the devices are copied there from the file's map, not through RAM first
        resident = bool(held) and all(s >= n for s, n in held)
        home = "mmap" if the_plan.home == "disk" or resident else "ram"
    else:
        home = "mmap" if cfg.cache_requested or the_plan.home == "disk" else "ram"
    return mf, ctx, the_plan, home


def kv_value_bytes(name: str | None, dtype: str) -> float:
    """Bytes per value of a KV cache type (None: the compute dtype's)."""
    return kv_type(name, getattr(torch, dtype)).bytes_per_value


def plan_for(cfg: RuntimeConfig) -> Plan:
    """The placement plan `build(cfg)` follows, from the model's metadata alone (no weights read): serve
    checks it, so a model that cannot be read or placed is one error line before the server starts."""
    mf, _, the_plan, _ = _prepare(cfg)
    mf.close()
    return the_plan


def _interleave(cfg: RuntimeConfig, the_plan: Plan):
    """What the loader may rewrite into the CPU kernels' layout: everything on CPU stages (with --repack); with
    device stages only the routed experts the plan computes on the CPU alone (a device reads the file's
    layout, and pages experts from their home)."""
    if not cfg.repack:
        return False
    if all(dp.device == "cpu" for dp in the_plan.devices):
        return True
    on_cpu = {layer for layer in range(the_plan.devices[-1].layers[1])
              if all(t.device == "cpu" and not t.cached for name, t in the_plan.tensors.items()
                     if name.startswith(f"blk.{layer}.") and "_exps" in name)}
    return lambda cn: tensor_class(cn.kind) == "routed_experts" and cn.layer in on_cpu


def _check_kernels(loaded, warnings: list[str]) -> None:
    if loaded.model.ops.name == "reference" and any(
            src.records[0].qtype.name not in ("F32", "F16", "BF16") for src in loaded.arch.sources.values()):
        from moerun.kernels import cpu

        warnings.append(f"quantized weights run on the slow torch reference: {cpu.features()['reason']}")


def build(cfg: RuntimeConfig, ahead: Preload | Arena | None = None) -> Runtime:
    """The engine of a single process, or rank 0's of a pipeline over processes. ahead: what was started for the
    weights before torch's import (`weights_ahead`: the reads, or memory faulted in), closed once they are read."""
    if cfg.pipeline_rank != 0 or cfg.ep_rank != 0:
        raise ValueError("build() runs rank 0; other ranks run serve_worker()")
    try:
        return _build(cfg, ahead)
    finally:
        if ahead is not None:
            ahead.close()  # returns the pages the weights did not take (nothing left if load_model closed it)


def _build(cfg: RuntimeConfig, ahead: Preload | Arena | None) -> Runtime:
    preload = ahead if isinstance(ahead, Preload) else None
    arena = ahead if isinstance(ahead, Arena) else None
    held = preload.held if preload is not None else 0 if arena is None else arena.faulted
    mf, ctx, the_plan, home = _prepare(cfg, held, None if preload is None else preload.mf)
    if cfg.pipeline_world_size > 1 or cfg.expert_parallel > 1:
        mf.close()
        if cfg.pipeline_world_size > 1:
            return _build_rank0(cfg, ctx, the_plan, home)
        return _build_expert_parallel(cfg, mf.path, ctx, the_plan, home)
    made: list[Tokenizer] = []  # built on this thread while the reading threads copy the weights
    loaded = load_model(mf, dtype=getattr(torch, cfg.dtype), home=home, interleave=_interleave(cfg, the_plan),
                        progress=cfg.progress, arena=arena, meanwhile=lambda: made.append(Tokenizer.from_model_file(mf)),
                        preload=preload)
    tok = made[0]
    warnings: list[str] = []
    _check_kernels(loaded, warnings)
    models = _stage_models(loaded.model, the_plan)
    if all(dp.device == "cpu" for dp in the_plan.devices):
        if cfg.vram_budget is not None:
            warnings.append("--vram-budget has no effect: no GPU runs this model (CPU only)")
        slots = _cache_slots(cfg, the_plan, loaded.model.store, warnings)
        if slots is None and cfg.prefetch:
            warnings.append("prefetch needs an expert cache (--expert-cache-slots or --expert-cache-mib); ignored")
        stages = [make_stage(cfg, m, slots) for m in models]
    else:
        if cfg.prefetch:
            warnings.append("prefetch is not implemented for device stages yet; ignored")
        stages = [device_stage(cfg, m, dp, the_plan, loaded.arch) for m, dp in zip(models, the_plan.devices)]
    model = stages[0].model if len(stages) == 1 else StagedModel(stages)
    caches = [st for st in stages if st.cache is not None]
    cache = None if not caches else caches[0].cache if len(stages) == 1 else StageCaches(stages)
    engine = Engine(model, tok, ctx_size=ctx, ubatch=cfg.ubatch, expert_cache=cache, draft=cfg.draft,
                    kv_types=(cfg.cache_type_k, cfg.cache_type_v))
    engine.drafter = make_drafter(cfg, engine)
    if cfg.mlock:
        from moerun.hostmem import lock_all

        warnings += filter(None, [lock_all()])
    return Runtime(engine, the_plan, cache, warnings, stages)


def make_drafter(cfg: RuntimeConfig, target: Engine):
    """The drafter cfg asks for (moerun.engine.speculative): prompt lookup, a draft model of the target's
    vocabulary (loaded whole into RAM, run on the CPU with the same threads), or None."""
    from moerun.engine.speculative import LookupDrafter, ModelDrafter, check_vocabularies

    if cfg.model_draft is not None and cfg.draft.lookup_ngram:
        raise MoerunError("give a draft model (--model-draft) or prompt lookup (--lookup-ngram), not both")
    if cfg.draft.lookup_ngram:
        return LookupDrafter(cfg.draft.lookup_ngram)
    if cfg.model_draft is None:
        return None
    loaded = load_model(model_path(cfg.model_draft), dtype=getattr(torch, cfg.dtype), home="ram")
    draft = Engine(loaded.model, Tokenizer.from_model_file(loaded.file), ctx_size=target.ctx_size,
                   ubatch=cfg.ubatch)
    check_vocabularies(target, draft)
    return ModelDrafter(draft)


def _join(cfg: RuntimeConfig, the_plan: Plan, home: str):
    """Join the process group, agree on rank 0's layer split, load this rank's layers and make its stage."""
    from moerun.distributed import Link, stage_weights

    link = Link.pipeline(cfg)
    bounds = link.bounds([d.layers[0] for d in the_plan.devices] + [the_plan.devices[-1].layers[1]])
    empty = [r for r in range(cfg.pipeline_world_size) if bounds[r] == bounds[r + 1]]
    if empty:  # every rank sees the same bounds, so every rank stops here with this line
        link.close()
        raise MoerunError(f"pipeline rank {', '.join(map(str, empty))} would hold no layers (split "
                          f"{bounds}); use fewer processes or another --tensor-split")
    layers = (bounds[cfg.pipeline_rank], bounds[cfg.pipeline_rank + 1])
    loaded = stage_weights(model_path(cfg.model), layers,
                           getattr(torch, cfg.dtype), home, interleave=cfg.repack)
    warnings: list[str] = []
    _check_kernels(loaded, warnings)
    if cfg.vram_budget is not None and all(d == "cpu" for d in cfg.stage_devices):
        warnings.append("--vram-budget has no effect: no GPU runs this model (CPU only)")
    slots = _cache_slots(cfg, the_plan, loaded.model.store, warnings)
    stage = make_stage(cfg, loaded.model, slots)
    return link, loaded, stage, warnings


def _build_rank0(cfg: RuntimeConfig, ctx: int, the_plan: Plan, home: str) -> Runtime:
    from moerun.distributed import PipelineModel, StageEngine

    link, loaded, stage, warnings = _join(cfg, the_plan, home)
    model = PipelineModel(stage, link)
    atexit.register(model.close)  # the other ranks stop when this process ends, however it ends
    engine = StageEngine(model, Tokenizer.from_model_file(loaded.file), ctx_size=ctx, ubatch=cfg.ubatch,
                         expert_cache=stage.cache)
    return Runtime(engine, the_plan, stage.cache, warnings, [stage], model)


def serve_worker(cfg: RuntimeConfig) -> None:
    """A pipeline rank other than 0: load its layers, run the steps rank 0 sends until it stops them. An
    expert-parallel rank other than 0: load its experts, and the same."""
    from moerun.distributed import serve_stage

    if cfg.pipeline_rank == 0 and cfg.ep_rank == 0:
        raise ValueError("rank 0 runs build(), not serve_worker()")
    mf, _, the_plan, home = _prepare(cfg)
    mf.close()
    if cfg.ep_rank:
        return _serve_expert_rank(cfg, the_plan, home)
    link, loaded, stage, _ = _join(cfg, the_plan, home)
    try:
        serve_stage(cfg, link, loaded.model, stage)
    finally:
        if stage.cache is not None:
            stage.cache.close()
        link.close()


# ------------------------------------------------------------------------------------ expert parallelism


def _rank_shard(cfg: RuntimeConfig, rank: int, ids: dict[int, list[int]], store, model, the_plan: Plan, arch,
                slots: dict[int, int] | None, biases: bool):
    """Rank `rank`'s Shard (moerun.model.shards) of `store`'s experts (ids: layer -> the model's ids of them, in
    the store's order) on its device, behind a cache of its own: on the CPU `slots` per layer (None: no cache),
    on a device as the plan sizes its slots; either capped by the rank's experts. biases: the model's expert
    biases are by its ids (cut them to the rank's)."""
    from moerun.model.gpu_ops import device_ops
    from moerun.model.shards import Shard
    from moerun.runtime_device import device_experts, home_layers

    dev = device.parse(cfg.ep_devices[rank if cfg.ep_world_size == 1 else 0])
    kernels = model.ops.name != "reference"
    cut = {}
    for i in ids if biases else ():
        exp_b = model.layers[i - model.first].exp_b
        if exp_b is not None:
            cut[i] = tuple(device.to_device(b[ids[i]], dev) for b in exp_b)
    if dev.accelerator:
        rp, dp = the_plan.rank(rank), the_plan.devices[0]
        ops = device_ops(dev, kernels)
        mine = dict(enumerate(rp.expert_slots)) if rp else dict(zip(range(*dp.layers), dp.expert_slots))
        experts, cache = device_experts(cfg, dev, ops, kernels, store, mine, home_layers(the_plan, store),
                                        arch)
    else:
        ops = model.ops
        experts, cache = cpu_experts(cfg, store, slots, kernels)
    return Shard(rank, ids, store, experts, cache, dev, ops, cut)


def _prefetch_warning(cfg: RuntimeConfig, the_plan: Plan, warnings: list[str]) -> None:
    """Under expert parallelism each rank's CPU cache prefetches its own experts of the guess
    (ShardedExperts); device ranks and ranks without a cache do not."""
    if not cfg.prefetch:
        return
    if any(d != "cpu" for d in cfg.ep_devices):
        warnings.append("prefetch is not implemented for device stages yet; ignored")
    elif not cfg.cache_requested and the_plan.home != "disk":
        warnings.append("prefetch needs an expert cache (--expert-cache-slots or --expert-cache-mib); "
                        "ignored")


def _build_expert_parallel(cfg: RuntimeConfig, path: Path, ctx: int, the_plan: Plan, home: str) -> Runtime:
    """Expert parallelism over devices of this process: the dense part once, on rank 0's device; each rank's
    share of every MoE layer's experts on its own device behind its own cache; their parts summed in rank order
    (moerun.model.shards). Across processes: _build_rank0_experts."""
    from moerun.expert_parallel import expert_split
    from moerun.model.gpu_ops import device_ops
    from moerun.model.shards import ShardedExperts

    if cfg.ep_world_size > 1:
        return _build_rank0_experts(cfg, ctx, the_plan, home)
    loaded = load_model(path, dtype=getattr(torch, cfg.dtype), home=home, interleave=_interleave(cfg, the_plan),
                        progress=cfg.progress)
    warnings: list[str] = []
    _check_kernels(loaded, warnings)
    _prefetch_warning(cfg, the_plan, warnings)
    model, split = loaded.model, expert_split(cfg, loaded.arch.spec)
    shards = [_rank_shard(cfg, r, split.shard(r), model.store.shard(split.shard(r)), model, the_plan, loaded.arch,
                          _cache_slots(cfg, the_plan, model.store, warnings if r == 0 else [], r), True)
              for r in range(cfg.expert_parallel)]
    lead = device.parse(cfg.ep_devices[0])
    if lead.accelerator:
        model.place(lead, device_ops(lead, model.ops.name != "reference"))
    model.experts = ShardedExperts(shards, loaded.arch.spec.n_experts, lead)
    stages = [Stage(model, sh.cache, f"rank {sh.rank} ({sh.dev})") for sh in shards]
    cache = StageCaches(stages, [sh.rank for sh in shards]) if any(st.cache is not None for st in stages) else None
    engine = Engine(model, Tokenizer.from_model_file(loaded.file), ctx_size=ctx, ubatch=cfg.ubatch,
                    expert_cache=cache, draft=cfg.draft, kv_types=(cfg.cache_type_k, cfg.cache_type_v))
    engine.drafter = make_drafter(cfg, engine)
    return Runtime(engine, the_plan, cache, warnings, stages)


def _join_experts(cfg: RuntimeConfig, the_plan: Plan, home: str):
    """Join the expert-parallel group, agree on rank 0's split, load this rank's experts (and the dense weights)."""
    from moerun.expert_parallel import agree, expert_split, join, load_shard
    from moerun.model.gpu_ops import device_ops
    from moerun.model.shards import ShardedExperts

    path = model_path(cfg.model)
    with open_model(path) as mf:
        spec = resolve(mf).spec
    link = join(cfg)
    split = agree(link, expert_split(cfg, spec))
    ids = split.shard(cfg.ep_rank)
    loaded = load_shard(path, ids, getattr(torch, cfg.dtype), home, interleave=_interleave(cfg, the_plan))
    warnings: list[str] = []
    _check_kernels(loaded, warnings)
    model = loaded.model
    _prefetch_warning(cfg, the_plan, warnings)
    slots = _cache_slots(cfg, the_plan, model.store, warnings, cfg.ep_rank)
    shard = _rank_shard(cfg, cfg.ep_rank, ids, model.store, model, the_plan, loaded.arch, slots, False)
    if shard.dev.accelerator:
        model.place(shard.dev, device_ops(shard.dev, model.ops.name != "reference"))
    model.experts = ShardedExperts([shard], spec.n_experts, shard.dev,
                                   gather=lambda t, layer: link.all_gather(t, f"summing layer {layer}'s experts"))
    return link, loaded, Stage(model, shard.cache, f"rank {cfg.ep_rank} ({shard.dev})"), warnings


def _build_rank0_experts(cfg: RuntimeConfig, ctx: int, the_plan: Plan, home: str) -> Runtime:
    from moerun.expert_parallel import ExpertParallelEngine, ExpertParallelModel, RankCaches

    link, loaded, stage, warnings = _join_experts(cfg, the_plan, home)
    model = ExpertParallelModel(stage, link)
    atexit.register(model.close)  # the other ranks stop when this process ends, however it ends
    caches = None if stage.cache is None else RankCaches(stage.cache, model)  # the engine's: every rank's
    engine = ExpertParallelEngine(model, Tokenizer.from_model_file(loaded.file), ctx_size=ctx, ubatch=cfg.ubatch,
                                  expert_cache=caches, draft=cfg.draft)
    engine.drafter = make_drafter(cfg, engine)
    return Runtime(engine, the_plan, stage.cache, warnings, [stage], model)


def _serve_expert_rank(cfg: RuntimeConfig, the_plan: Plan, home: str) -> None:
    from moerun.expert_parallel import serve_rank

    link, loaded, stage, _ = _join_experts(cfg, the_plan, home)
    try:
        serve_rank(link, loaded.model, stage)
    finally:
        if stage.cache is not None:
            stage.cache.close()
        link.close()

