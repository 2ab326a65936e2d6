"""Each expert-parallel rank's expert cache in /metrics (issue 40): the expert-cache counters carry a rank label,
one series per rank under expert parallelism in one process (rank "0" alone otherwise), each equal to that rank's
own statistics, their sum the totals; the scheduler's copy of StageStats keeps the ranks apart."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_expert_parallel import model_file

from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.pipeline import StageStats
from moerun.engine.scheduler import Request, Scheduler
from moerun.experts.stats import CacheStats
from moerun.runtime import build
from moerun.server.metrics import Telemetry


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_file(tmp_path_factory, "tiny-qwen3moe")


def metrics(telemetry: Telemetry, name: str) -> dict[tuple[str, int, str], float]:
    """(rank, layer, phase) -> value of one moerun:expert_cache_* counter."""
    out = {}
    for fam in text_string_to_metric_families(telemetry.render().decode()):
        for s in fam.samples:
            if s.name == f"moerun:{name}_total":
                out[(s.labels["rank"], int(s.labels["layer"]), s.labels["phase"])] = s.value
    return out


@pytest.mark.parametrize("ranks", [1, 2])
def test_metrics_show_each_ranks_cache(tiny, ranks):
    rt = build(RuntimeConfig(model=tiny, threads=1, expert_parallel=ranks, expert_cache_slots=1))
    sched = Scheduler(rt.engine, parallel=1)
    req = Request(list(range(5, 30)), SamplingParams.greedy(max_tokens=6, ignore_eos=True))
    req.emit = lambda event: None
    sched.submit(req)
    while sched.has_work():
        sched.step()
    telemetry = Telemetry(sched.snapshot)
    hits, queries = metrics(telemetry, "expert_cache_hits"), metrics(telemetry, "expert_cache_queries")
    per_rank = dict(rt.stage_stats())
    rt.close()
    assert {r for r, _, _ in queries} == {str(r) for r in range(ranks)}
    for r, (_, stats) in enumerate(per_rank.items()):
        for (rank, layer, phase), n in queries.items():
            if rank == str(r):
                c = stats.get(layer, phase)
                assert (hits[(rank, layer, phase)], n) == (c.hits, c.queries)
    totals = sched.snapshot().cache
    assert sum(queries.values()) == totals.get().queries > 0
    assert sum(v for (_, _, ph), v in queries.items() if ph == "decode") == totals.get(phase="decode").queries


def test_a_copy_of_stage_stats_keeps_each_rank():
    a, b = CacheStats(), CacheStats()
    a.record_step(0, "decode", hits=3, misses=1)
    b.record_step(0, "decode", hits=1, misses=1)
    live = StageStats([a, b], ranks=[0, 1])
    copy = live + CacheStats()
    a.record_step(0, "decode", hits=5, misses=0)
    assert isinstance(copy, StageStats) and copy.ranks == (0, 1)
    assert [p.get().hits for p in copy.parts] == [3, 1] and copy.get().queries == 6
    assert (CacheStats() + live).get().hits == 9  # a plain sum stays a CacheStats


def test_the_periodic_log_line_gives_each_ranks_hit_rate(caplog):
    """vLLM's periodic line: the expert cache's hit rate since the last line, then each rank's in parentheses."""
    import logging
    from types import SimpleNamespace

    from moerun.server.metrics import ThroughputLog

    a, b = CacheStats(), CacheStats()
    a.record_step(0, "decode", hits=3, misses=1)
    b.record_step(0, "decode", hits=1, misses=1)
    snaps = []

    def snap():
        return SimpleNamespace(prompt_tokens=0, generated_tokens=len(snaps), running=1, waiting=0, kv_usage=0.1,
                               cache=StageStats([a, b], ranks=[0, 1]) + CacheStats())

    tick = ThroughputLog(lambda: snaps.append(snap()) or snaps[-1], interval=1e-9)
    tick.tick()  # the first snapshot: nothing to compare with yet
    a.record_step(0, "decode", hits=9, misses=1)  # rank 0: 9 of 10 since
    b.record_step(0, "decode", hits=1, misses=3)  # rank 1: 1 of 4
    with caplog.at_level(logging.INFO, logger="moerun.server"):
        tick.tick()
    line = caplog.records[-1].getMessage()
    assert "Expert cache hit rate: 71.4% (rank 0 90.0%, rank 1 25.0%), paged in" in line, line
