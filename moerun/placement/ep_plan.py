"""Expert parallelism's placement (DESIGN decision 16): each rank planned for its shard, against its memory.

A rank holds its share of every MoE layer's routed experts (the split's counts) and, in a process of its own,
a copy of the dense part and every layer's KV; its expert cache and the choice between RAM and the file's map
follow those bytes against its own budget (`plan(..., owned=...)`), not the whole model's. So
`--expert-cache-mib M` is per rank, a layer's cache never has more slots than the rank owns, and a rank whose
shard fits its RAM keeps it there where one process could not.

In one process the ranks share it: on CPUs the host's RAM budget holds the dense part and the KV once and
what is left is shared equally by the ranks' experts; on devices (`standin:N`, `cuda:N`) each rank has its own
device's budget (`--vram-budget`: one figure, or one per device) and rank 0's device holds the dense part and
the KV too. The process loads its experts once, so it has one home: RAM when every rank's experts fit (a rank
whose shard fits a RAM budget of its own but whose process maps the file caches all of its experts).
"""

from __future__ import annotations

from dataclasses import replace

from moerun.placement.devices import Inventory
from moerun.placement.expert_split import ExpertSplit
from moerun.placement.planner import Budgets, Plan, PlanError, RankPlan, plan


def owned_counts(split: ExpertSplit, rank: int) -> dict[int, int]:
    """MoE layer -> how many of its experts `rank` owns."""
    return {layer: len(split.owned(rank, layer)) for layer in split.owner}


def plan_ranks(arch, inventory: Inventory, budgets: Budgets, split: ExpertSplit, devices: tuple[str, ...],
               rank: int | None = None) -> Plan:
    """rank None: every rank in this process, rank r on devices[r] (budgets.devices: those devices,
    budgets.vram by distinct device as Budgets takes it); rank r: this process is rank r alone, on devices[0],
    with the dense part. -> the plan of the first rank planned, its `ranks` every planned rank's figures."""
    ranks = list(range(split.ranks)) if rank is None else [rank]
    devs = devices if rank is None else devices[:1]
    cpu = set(devs) == {"cpu"}
    ram = inventory.ram_available if budgets.ram is None else budgets.ram
    share = None
    if cpu and len(ranks) > 1:  # the dense part and KV once, the rest of the RAM budget shared by the ranks
        alone = replace(budgets, devices=("cpu",), tensor_split=None, vram=None, cache_slots=None,
                        cache_mib=None)
        base = plan(arch, inventory, alone, owned=dict.fromkeys(split.owner, 0))
        share = (ram - base.ram_bytes) // len(ranks)
    plans = []
    for k, r in enumerate(ranks):
        dev, lead = devs[k], k == 0
        if cpu:
            ram_r = ram if share is None else share + (base.ram_bytes if lead else 0)
            b = replace(budgets, devices=("cpu",), tensor_split=None, vram=None, ram=ram_r)
        else:
            b = replace(budgets, devices=(dev,), tensor_split=None, vram=_vram(inventory, budgets, devs, dev))
        try:
            plans.append(plan(arch, inventory, b, owned=owned_counts(split, r),
                              dense=lead or rank is not None))
        except PlanError as e:
            raise PlanError(f"expert-parallel rank {r} ({dev}): {e}") from None
    home = plans[0].home
    if len(plans) > 1:  # one process, one load: its experts in RAM only when every rank's fit
        if cpu:
            home = "ram" if all(p.home == "ram" for p in plans) else "disk"
        else:
            home = "ram" if sum(_host(p) for p in plans) <= ram else "disk"
    figures = tuple(_rank(r, p, owned_counts(split, r), home, arch.spec.n_layers, cpu and share is not None)
                    for r, p in zip(ranks, plans))
    first = plans[0]
    if home != first.home:  # the process's home, and the first rank's slots under it
        f = figures[0]
        devices = tuple(replace(d, expert_slots=f.expert_slots[d.layers[0]:d.layers[1]],
                                cache_bytes=f.cache_bytes) for d in first.devices)
        tensors = {n: replace(t, tier=home) if t.tier in ("ram", "disk") and "_exps" in n else t
                   for n, t in first.tensors.items()}
        first = replace(first, home=home, devices=devices, tensors=tensors)
    return replace(first, ranks=figures)


def _vram(inventory: Inventory, budgets: Budgets, devs: tuple[str, ...], dev: str) -> int | None:
    """Rank's device budget: budgets.vram's figure for it (per distinct device, or one for all), shared by the
    ranks on that device."""
    distinct = list(dict.fromkeys(budgets.devices))
    v = budgets.vram
    if isinstance(v, tuple):
        v = v[distinct.index(dev)] if dev in distinct else None
    n = devs.count(dev)
    if n > 1:
        v = (v if v is not None else inventory.gpu(dev).free_bytes) // n
    return v


def _host(p: Plan) -> int:
    """Bytes a rank's plan keeps in host memory or the file: its routed experts, what is pinned to the CPU."""
    return sum(t.nbytes for t in p.tensors.values() if t.tier in ("ram", "disk"))


def _rank(r: int, p: Plan, owned: dict[int, int], home: str, n_layers: int, cpu_shared: bool) -> RankPlan:
    counts = tuple(owned.get(i, 0) for i in range(n_layers))
    slots = [0] * n_layers
    for d in p.devices:
        slots[d.layers[0]:d.layers[1]] = d.expert_slots
    expert_bytes = sum(t.nbytes for n, t in p.tensors.items() if "_exps" in n)
    cache = sum(d.cache_bytes for d in p.devices)
    if home == "disk" and p.home == "ram" and p.devices[0].device == "cpu":
        # its shard fits its RAM but the process maps the file (another rank's does not fit): cache all of it
        slots, cache = list(counts), expert_bytes
    d = p.devices[0]
    ram = p.ram_bytes if p.home == home else sum(d.dense_bytes + d.kv_bytes for d in p.devices) + cache
    return RankPlan(r, d.device, counts, expert_bytes, tuple(slots), cache, home, d.budget,
                    sum(x.dense_bytes for x in p.devices), sum(x.kv_bytes for x in p.devices),
                    sum(x.workspace_bytes for x in p.devices), ram)
