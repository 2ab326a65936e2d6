"""Expert parallelism's plan (issue 40): each rank sized for its own shard against its own memory, the
RAM-or-map choice made by the shard's bytes, and prefetch on the ranks' CPU caches (moerun.placement.ep_plan,
ShardedExperts.prefetch)."""

from __future__ import annotations

import pytest
import torch
from test_expert_parallel import PROMPT, close, model_file, run, split_file, steps

from moerun.config import RuntimeConfig, SamplingParams
from moerun.placement.planner import Plan
from moerun.runtime import _prepare, build, plan_for

KiB = 1024


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return model_file(tmp_path_factory, "tiny-qwen3moe")  # 3 MoE layers of 8 experts, 4 per token


def figures(path: str) -> tuple[int, int, int]:
    """(dense + KV bytes, all routed experts' bytes, one expert of every MoE layer: a slot in each layer)."""
    whole = plan_for(RuntimeConfig(model=path, threads=1))
    d = whole.devices[0]
    experts = sum(t.nbytes for n, t in whole.tensors.items() if "_exps" in n)
    return d.dense_bytes + d.kv_bytes, experts, experts // 8


def test_a_rank_whose_shard_fits_its_ram_keeps_it_there(path):
    """A RAM budget the whole model overflows but dense + half the experts fit: one process maps the file and
    caches, each of 2 processes' ranks plans its own shard (half the experts) and keeps it in RAM."""
    base, experts, _ = figures(path)
    budget = base + experts * 5 // 8  # 5 of 8 experts per layer
    one = RuntimeConfig(model=path, threads=1, ram_budget=budget)
    assert plan_for(one).home == "disk" and _prepare(one)[3] == "mmap"
    for rank in (0, 1):
        cfg = RuntimeConfig(model=path, threads=1, ram_budget=budget, ep_world_size=2, ep_rank=rank)
        _, _, the_plan, home = _prepare(cfg)
        (rp,) = the_plan.ranks
        print(the_plan.table())
        assert (rp.rank, rp.owned, rp.home, home) == (rank, (4, 4, 4), "ram", "ram")
        assert rp.expert_bytes == experts // 2 and rp.budget == budget and rp.cache_bytes == 0
        assert rp.ram_bytes == base + experts // 2 <= budget
        assert the_plan.home == "ram" and "rank | device" in the_plan.table()
        assert Plan.from_json(the_plan.to_json()) == the_plan
    # a split file's counts: rank 1 owns 2 experts of each layer, rank 0 six, which overflow
    from moerun.placement.expert_split import ExpertSplit

    split = path + ".split.json"
    ExpertSplit(2, {i: (0, 0, 0, 1, 0, 0, 1, 0) for i in range(3)}).write(split)
    plans = [plan_for(RuntimeConfig(model=path, threads=1, ram_budget=budget, ep_world_size=2, ep_rank=r,
                                    expert_split=split)).ranks[0] for r in (0, 1)]
    assert [(p.owned, p.home) for p in plans] == [((6, 6, 6), "disk"), ((2, 2, 2), "ram")]
    assert plans[0].expert_slots == (5, 5, 5)  # what its budget leaves


def test_a_rank_loads_its_shard_into_ram_by_its_home(path):
    """The home _prepare gives rank 1 loads its experts into memory moerun owns (no file reader behind)."""
    from moerun.expert_parallel import load_shard

    base, experts, _ = figures(path)
    cfg = RuntimeConfig(model=path, threads=1, ram_budget=base + experts * 5 // 8, ep_world_size=2, ep_rank=1)
    home = _prepare(cfg)[3]
    loaded = load_shard(path, {i: [4, 5, 6, 7] for i in range(3)}, torch.float32, home)
    assert loaded.model.store.reader is None and loaded.model.store.n_experts(0) == 4


def test_expert_cache_mib_is_per_rank_and_capped_by_its_experts(path):
    _, _, per = figures(path)
    for mib, want in ((3 * per / 2**20, 3), (7 * per / 2**20, 4)):  # 3 slots per layer; 7 asked, 4 owned
        cfg = RuntimeConfig(model=path, threads=1, expert_parallel=2, expert_cache_mib=mib)
        the_plan = plan_for(cfg)
        assert [r.expert_slots for r in the_plan.ranks] == [(want,) * 3] * 2
        assert [r.cache_bytes for r in the_plan.ranks] == [want * per] * 2
        rt = build(cfg)
        assert [c.nbytes for c in rt.engine.model.experts.caches] == [want * per] * 2
        rt.close()


def test_ranks_in_one_process_share_its_ram(path):
    """No cache asked for, the experts overflow the RAM budget: the ranks' caches together fit what the dense
    part and KV leave (each rank its half), where each used to be sized as if it had all of it."""
    base, _experts, per = figures(path)
    budget = base + 5 * per  # 5 slots per layer in all
    cfg = RuntimeConfig(model=path, threads=1, expert_parallel=2, ram_budget=budget)
    the_plan = plan_for(cfg)
    print(the_plan.table())
    assert the_plan.home == "disk" and [r.expert_slots for r in the_plan.ranks] == [(2, 2, 2)] * 2
    assert sum(r.cache_bytes for r in the_plan.ranks) <= budget - base
    rt = build(cfg)
    assert [c.nbytes for c in rt.engine.model.experts.caches] == [2 * per] * 2
    rt.close()


def test_each_device_rank_has_its_own_budget(path):
    """Stand-in devices with a --vram-budget each: rank 1's device holds only experts and its workspace,
    and its slots are what its own budget gives; the output is one rank's."""
    _, _, per = figures(path)
    devices = ("standin:0", "standin:1")
    roomy = plan_for(RuntimeConfig(model=path, threads=1, expert_parallel=2, devices=devices))
    r0, r1 = roomy.ranks
    assert r1.dense_bytes == r1.kv_bytes == 0 < r0.dense_bytes
    vram = (2**30, r1.workspace_bytes + 2 * per + 100)  # rank 1: 2 slots per layer
    cfg = RuntimeConfig(model=path, threads=1, expert_parallel=2, devices=devices, vram_budget=vram,
                        expert_cache_slots=8)
    the_plan = plan_for(cfg)
    assert [r.expert_slots for r in the_plan.ranks] == [(4, 4, 4), (2, 2, 2)]
    assert [r.budget for r in the_plan.ranks] == list(vram)
    ref_tokens, ref, _ = run(path, devices=devices[:1])
    tokens, logits, stats = run(path, expert_parallel=2, devices=devices, vram_budget=vram,
                                expert_cache_slots=8)
    assert tokens == ref_tokens and close(logits, ref)
    assert stats["rank 1 (standin:1)"].misses > 0  # its 2 slots of 4 experts miss


@pytest.mark.parametrize("kw", [{"expert_parallel": 2}, {"expert_parallel": 3},
                                {"expert_parallel": 2, "expert_split": "rotated"}])
def test_prefetch_on_every_rank(path, tmp_path, kw):
    """With prefetch each rank's cache pages in its own experts of the guess: the same greedy tokens and
    logits as one process without it, and every rank's guesses used."""
    if kw.get("expert_split"):
        kw = {**kw, "expert_split": split_file(tmp_path / "s.json", 2, 8, [0, 1, 2])}
    ref_tokens, ref, _ = run(path)
    tokens, logits, stats = run(path, expert_cache_slots=2, prefetch=True, **kw)
    assert tokens == ref_tokens and close(logits, ref)
    assert len(stats) == kw["expert_parallel"]
    for name, s in stats.items():
        print(name, s.prefetch_issued, s.prefetch_used, s.prefetch_needed)
        assert s.prefetch_issued > 0 and s.prefetch_used > 0, name


def test_prefetch_warnings_under_expert_parallelism(path):
    rt = build(RuntimeConfig(model=path, threads=1, expert_parallel=2, prefetch=True, expert_cache_slots=2))
    assert not any("prefetch" in w for w in rt.warnings) and rt.engine.model.experts.prefetching
    rt.close()
    rt = build(RuntimeConfig(model=path, threads=1, expert_parallel=2, prefetch=True))
    assert any("prefetch needs an expert cache" in w for w in rt.warnings)
    assert not rt.engine.model.experts.prefetching
    rt.engine.generate(PROMPT, SamplingParams.greedy(max_tokens=2, ignore_eos=True)).run()
    rt.close()


@pytest.mark.slow
def test_prefetch_over_processes(path):
    """Each process's rank prefetches its own experts: rank 0's and rank 1's guesses both used, and the output
    one process's."""
    from test_expert_parallel_dist import start_ranks, stop

    one_tokens, one = steps(build(RuntimeConfig(model=path, threads=1)))
    rt, workers = start_ranks(path, 2, expert_cache_slots=2, prefetch=True)
    tokens, logits = steps(rt)
    stats = dict(rt.stage_stats())
    assert not any("prefetch" in w for w in rt.warnings)
    assert all(rc == 0 for rc, _, _ in stop(rt, workers))
    assert tokens == one_tokens and close(logits, one)
    assert len(stats) == 2
    for name, s in stats.items():
        c = s.get()
        print(name, c.prefetch_issued, c.prefetch_used, c.prefetch_needed)
        assert c.prefetch_used > 0, name
