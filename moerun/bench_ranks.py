"""`moerun bench` over processes: expert parallelism (`--ep-world-size`) or pipeline stages
(`--pipeline-world-size`), every process running the same command with its own rank.

Rank 0 runs the tests and prints them; every other rank serves each test's runtime in turn (`serve_tests`). A
test is one build (as a placed test is: an expert cache size is part of it), so the group is joined afresh for
each test, on the next port (`master_port` + the test's number - 1): a test's group never meets the last one's.

An expert-parallel test across processes adds to its record `ep_gathers` (all-gathers per step on rank 0: one per
MoE layer) and `ep_gather_ms` (per rank, milliseconds a step spent in them, waiting for the slowest rank's part
included; a step is a generated token for tg, a prompt chunk for pp), from the ranks' Link counters over the
timed runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def across_processes(placement: dict | None) -> bool:
    """Whether the placement's ranks are processes (else one process runs the test)."""
    return bool(placement) and (placement.get("ep_world_size", 1) > 1 or placement.get("pipeline_world_size", 1) > 1)


def for_test(placement: dict, number: int) -> dict:
    """The placement of test `number` (1..): its group's port."""
    if not across_processes(placement):
        return placement
    return placement | {"master_port": placement.get("master_port", 29500) + number - 1}


def serve_tests(cases: Sequence, placement: dict, config: Callable) -> None:
    """A rank other than 0: serve every test's runtime in turn, as rank 0 builds them (config(case, placement)
    -> the test's RuntimeConfig)."""
    from moerun.runtime import serve_worker

    for number, case in enumerate(cases, 1):
        serve_worker(config(case, for_test(placement, number)))


def reset(rt) -> None:
    """Between warm-up and timed runs: the ranks' expert-cache and all-gather counters start again."""
    rt.stage_stats(reset=True)
    if hasattr(rt.pipeline, "gathers"):
        rt.pipeline.gathers(reset=True)


def steps(case, reps: int) -> int:
    """Forward steps of a test's timed runs: tokens generated, or prompt chunks."""
    return reps * (case.n_gen if case.n_gen else -(-case.n_prompt // case.n_ubatch))


def gather_fields(rt, case, reps: int) -> dict:
    """ep_gathers and ep_gather_ms of an expert-parallel test across processes (nothing for other tests)."""
    if not hasattr(rt.pipeline, "gathers"):
        return {}
    n = steps(case, reps)
    per_rank = rt.pipeline.gathers()
    return {"ep_gathers": per_rank[0][0] / n, "ep_gather_ms": [s * 1e3 / n for _, s in per_rank]}


def devices_label(rt) -> str:
    """A placed test's devices in one process: its stages' (the plan's), or under expert parallelism its ranks'."""
    shards = getattr(rt.engine.model.experts, "shards", None) if hasattr(rt.engine.model, "experts") else None
    return ",".join(str(sh.dev) for sh in shards) if shards else ",".join(d.device for d in rt.plan.devices)


def rank_fields(rt, stages: list[dict]) -> dict:
    """A test across processes: its devices and the ranks' cache counters; no estimate (`moerun estimate
    --expert-parallel N --link-gbps G --link-latency-us L` takes the link this command does not know)."""
    from moerun import device

    name = rt.plan.devices[0].device
    dev = device.parse(name)
    return {"devices": f"{rt.pipeline.link.world} processes ({name})", "expert_cache_stages": stages or None, "estimate_ts": None,
            "backends": {"cuda": "CUDA", "standin": "stand-in"}.get(dev.kind, "CPU"), "gpu_info": device.describe(dev)}

