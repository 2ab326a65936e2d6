"""Expert-cache policies, statistics, routing traces and their replay (no tensors, no model)."""

from __future__ import annotations

import json
import random
import sys
from functools import cache

import pytest
from click.testing import CliRunner

from moerun.cli import main
from moerun.errors import MoerunError
from moerun.experts.policy import ARC, LFRU, LFU, LRU, POLICIES, Load, SlotTable, make_policy
from moerun.experts.stats import CacheStats
from moerun.experts.trace import (
    TraceFormatError,
    TraceHeader,
    TraceRecord,
    TraceWriter,
    belady,
    read_trace,
    simulate,
)


def run(steps, slots, policy):
    """Drive a SlotTable; returns (hits, misses, evictions, evicted experts in order)."""
    table = SlotTable(slots, policy)
    hits = misses = 0
    evicted = []
    for step in steps:
        plan = table.request(step)
        hits += len(plan.hits)
        misses += plan.misses
        evicted += [ld.evicted for ld in plan.loads if ld.evicted is not None]
    return hits, misses, len(evicted), evicted


def records(steps, layer=0, phase="decode"):
    return [TraceRecord("r", i, phase, layer, tuple(s), (1.0 / len(s),) * len(s)) for i, s in enumerate(steps)]


def header(n_layers=1, n_experts=16, k=2):
    return TraceHeader("test", n_layers, n_experts, k)


# One expert per step, 2 slots; the clock ticks once per access, t1..t9.
SEQ = [[1], [1], [1], [2], [3], [2], [3], [2], [3]]


def test_lru_hand_computed():
    # t1 1 miss, t2-t3 hits, t4 2 miss (free slot). t5 3 miss: 1 last used t3, 2 at t4 -> evict 1.
    # t6..t9 alternate 2 and 3, both resident: 4 hits.
    assert run(SEQ, 2, LRU()) == (6, 3, 1, [1])
    # 1,2,1,3,2,3,1: t4 3 evicts 2 (t2 < t3), t5 2 evicts 1 (t3 < t4), t6 3 hit, t7 1 evicts 2 (t5 < t6).
    assert run([[1], [2], [1], [3], [2], [3], [1]], 2, "lru") == (2, 5, 3, [2, 1, 2])


def test_lfu_hand_computed():
    # counts after t3: 1 -> 3. t4 2 miss (free). t5 3: 2 has 1 < 3 -> evict 2. t6 2: 3 has 1 -> evict 3.
    # t7 3: 2 has 2 < 3 -> evict 2. t8 2: 3 has 2 -> evict 3. t9 3: 1 and 2 both have 3, tie ->
    # least recent: 1 (t3) before 2 (t8) -> evict 1. Only t2, t3 hit.
    assert run(SEQ, 2, LFU()) == (2, 7, 5, [2, 3, 2, 3, 1])


def test_lfru_hand_computed():
    # decay 0.75 per access. Score of 1 at t3: 0.75**2 + 0.75 + 1 = 2.3125.
    # t5 3 miss, victim at clock 4: s1 = 2.3125*0.75 = 1.734, s2 = 1 -> evict 2 (LRU would evict 1).
    # t6 2 miss, clock 5: s1 = 2.3125*0.75**2 = 1.301, s3 = 1 -> evict 3; s2 = 0.75**2 + 1 = 1.5625 at t6.
    # t7 3 miss, clock 6: s1 = 2.3125*0.75**3 = 0.976 < s2 = 1.5625 -> evict 1 (LFU never would).
    # t8 2 hit, t9 3 hit.
    assert run(SEQ, 2, LFRU(decay=0.75)) == (4, 5, 3, [2, 3, 1])
    p = LFRU(decay=0.75)
    for k in (1, 1, 1):
        p.on_hit(k)
    assert p.score(1) == 2.3125


def test_arc_hand_computed():
    # t1 1 into T1, t2-t3 hits move it to T2. t4 2 into T1 (free slot). t5 3: T1 = {2} is over p = 0 -> evict
    # 2 to ghost list B1. t6 2: T1 = {3} over p -> evict 3 to B1; 2 was a B1 ghost: p -> 1, 2 enters T2.
    # t7 3: T1 is empty -> T2's least recent, 1 (t3 < t6), goes to B2; 3 was a B1 ghost: p -> 2. t8, t9 hit.
    pol = ARC()
    assert run(SEQ, 2, pol) == (4, 5, 3, [2, 3, 1])
    assert pol.p == 2.0 and pol._t2 == {2, 3} and list(pol._b2) == [1]


def test_arc_resists_scans_and_follows_shifts():
    # A hot set of 4 with a one-off expert between its uses: LRU lets every one-off push a hot one out;
    # ARC keeps one-offs in T1 and evicts them first, as LFU does.
    rng, fresh = random.Random(7), iter(range(1000, 10**6))
    steps = [[rng.randrange(4)] if i % 2 == 0 else [next(fresh)] for i in range(3000)]
    rate = {p: simulate(records(steps), 5, p).hit_rate() for p in ("lru", "lfu", "arc")}
    assert rate["arc"] > rate["lru"] + 0.2 and rate["arc"] > rate["lfu"] - 0.01
    # The working set moves every 300 steps: ARC follows it as LRU does, where LFU clings to the old one.
    rng = random.Random(4)
    steps = [[rng.choice(range(4 * phase, 4 * phase + 4))] for phase in range(6) for _ in range(300)]
    rate = {p: simulate(records(steps), 4, p).hit_rate() for p in ("lru", "lfu", "arc")}
    assert rate["arc"] > rate["lfu"] + 0.3 and rate["arc"] > rate["lru"] - 0.01


def test_lfru_half_decay_is_lru():
    rng = random.Random(5)
    steps = [[rng.randrange(6)] for _ in range(200)]
    assert run(steps, 3, LFRU(decay=0.5)) == run(steps, 3, LRU())


def test_pinned_experts_are_never_evicted():
    # slots 3, LRU. (1,2): t1 1, t2 2. (3,1): 3 takes the free slot (t3), 1 hits (t4).
    # (4,2): 4 misses with 1 (t4), 2 (t2), 3 (t3) resident; 2 is the LRU but the step pins it,
    # so the victim is 3 (t3 < t4) and 4 takes 3's slot, slot 2. Then 2 hits.
    table = SlotTable(3, "lru")
    assert table.request([1, 2]).loads == (Load(1, 0, None), Load(2, 1, None))
    plan = table.request([3, 1])
    assert plan.hits == (1,) and plan.loads == (Load(3, 2, None),)
    plan = table.request([4, 2])
    assert plan.loads == (Load(4, 2, 3),) and plan.hits == (2,) and plan.evictions == 1
    assert table.resident == {1: 0, 2: 1, 4: 2}
    # Random multi-expert steps: every step's experts end resident, for every policy.
    rng = random.Random(0)
    for pol in POLICIES:
        table = SlotTable(4, pol)
        for _ in range(300):
            step = rng.sample(range(10), rng.randint(1, 4))
            plan = table.request(step)
            assert not {ld.evicted for ld in plan.loads} & set(step)
            assert set(step) <= set(table.resident)


def test_more_experts_than_slots_are_bypassed():
    table = SlotTable(2, "lru")
    plan = table.request([1, 2, 3, 2])  # duplicates count once
    assert plan.hits == () and [ld.expert for ld in plan.loads] == [1, 2] and plan.bypassed == (3,)
    assert plan.misses == 3 and plan.evictions == 0
    assert table.request([3]).loads == (Load(3, 0, 1),)  # 1 (t1) is older than 2 (t2)


def test_prefetch_is_not_an_access():
    table = SlotTable(2, "lru")
    table.request([1])
    assert table.prefetch(2) == Load(2, 1, None)
    assert table.prefetch(2) is None  # already resident
    # 3 misses: 1 was used at t1, 2 never (a wrong guess) -> 2 goes first.
    assert table.request([3]).loads == (Load(3, 1, 2),)
    assert table.prefetch(4, pinned={1, 3}) is None  # nothing evictable


def test_make_policy_and_errors():
    assert [make_policy(n).name for n in ("lru", "LFU", " lfru ", "Arc")] == ["lru", "lfu", "lfru", "arc"]
    assert make_policy("lfru", decay=0.9).decay == 0.9
    with pytest.raises(ValueError, match="unknown expert cache policy 'fifo'.*lru, lfu, lfru, arc"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="pinned"):
        LRU().victim([])
    with pytest.raises(ValueError):
        LFRU(decay=1.0)
    with pytest.raises(ValueError):
        SlotTable(0)


# -- Belady -----------------------------------------------------------------------------------
def brute_force_hits(steps, slots):
    """Most hits over every sequence of eviction choices (same rules: step pinned, misses loaded)."""
    steps = [tuple(dict.fromkeys(s)) for s in steps]

    @cache
    def go(i, j, resident):
        if i == len(steps):
            return 0
        if j == len(steps[i]):
            return go(i + 1, 0, resident)
        e = steps[i][j]
        if e in resident:
            return 1 + go(i, j + 1, resident)
        if len(resident) < slots:
            return go(i, j + 1, resident | {e})
        return max(go(i, j + 1, (resident - {c}) | {e}) for c in resident - set(steps[i]))

    return go(0, 0, frozenset())


def random_steps(rng, n_steps, n_experts, k):
    return [rng.sample(range(n_experts), rng.randint(1, k)) for _ in range(n_steps)]


def test_belady_equals_brute_force_optimum():
    rng = random.Random(1)
    for _ in range(30):
        slots = rng.randint(2, 3)
        steps = random_steps(rng, 9, 5, slots)
        assert belady(records(steps), slots).get().hits == brute_force_hits(steps, slots)


def test_belady_bounds_every_policy():
    rng = random.Random(2)
    for _ in range(15):
        slots = rng.randint(2, 6)
        recs = records(random_steps(rng, 80, 10, 2))
        best = belady(recs, slots).get()
        for pol in POLICIES:
            s = simulate(recs, slots, pol).get()
            assert s.queries == best.queries and s.hits <= best.hits


def zipf_steps(rng, n_steps, n_experts, k, s=1.2):
    weights = [1 / (i + 1) ** s for i in range(n_experts)]
    out = []
    for _ in range(n_steps):
        step = []
        while len(step) < k:
            e = rng.choices(range(n_experts), weights)[0]
            if e not in step:
                step.append(e)
        out.append(step)
    return out


def test_skewed_popularity_favours_frequency_and_shifting_favours_recency():
    # Zipf-like popularity: the popular experts deserve their slots; LRU lets one-off experts in.
    recs = records(zipf_steps(random.Random(3), 3000, 32, 2))
    rate = {p: simulate(recs, 8, p).hit_rate() for p in ("lru", "lfu", "lfru", "belady")}
    assert rate["lfu"] > rate["lru"] + 0.05 and rate["lfru"] > rate["lru"] + 0.02
    assert rate["belady"] >= max(rate.values())
    # Recency-heavy: the working set moves every 300 steps; LFU clings to the old favourites.
    rng = random.Random(4)
    steps = [[rng.choice(range(4 * phase, 4 * phase + 4))] for phase in range(6) for _ in range(300)]
    rate = {p: simulate(records(steps), 4, p).hit_rate() for p in ("lru", "lfu", "lfru")}
    assert rate["lru"] > rate["lfu"] + 0.3 and rate["lfru"] > rate["lfu"] + 0.3


# -- stats --------------------------------------------------------------------------------------
def test_cache_stats_record_merge_and_lines():
    a, b = CacheStats(), CacheStats()
    a.record_step(0, "prefill", hits=3, misses=1, evictions=1, bytes_paged_in=2**20, seconds_stalled=0.25)
    a.record_step(0, "decode", hits=6, misses=2, bytes_paged_in=2**20)
    b.record_step(1, "decode", hits=2, misses=0, seconds_stalled=0.5)
    b.record_prefetch(1, "decode", guessed=[1, 2, 3, 4], needed=[2, 3, 5])
    m = a.merge(b)
    assert m == a + b and m.layers() == [0, 1]
    assert m.hit_rate() == 11 / 14 and m.hit_rate(phase="decode") == 8 / 10 and m.hit_rate(layer=1) == 1.0
    assert m.hit_rate(layer=7) is None
    d = m.get(phase="decode")
    assert (d.queries, d.prefetch_precision, d.prefetch_recall) == (10, 0.5, 2 / 3)
    assert m.summary_line() == ("expert cache: prefill hit rate 75.0% (3/4), decode hit rate 80.0% (8/10), "
                                "2.0 MiB paged in, 0.75 s stalled, prefetch precision 50.0% recall 66.7%")
    lines = m.per_layer_lines()
    assert lines[0] == ("layer   0: prefill  75.0% (3/4), decode  75.0% (6/8), 1 evictions, 2.0 MiB in, "
                        "0.25 s stalled")
    assert lines[1].startswith("layer   1: decode 100.0% (2/2), 0 evictions")
    d = json.loads(json.dumps(m.to_dict()))
    assert d["total"]["all"]["hits"] == 11 and d["layers"]["0"]["prefill"]["hit_rate"] == 0.75
    assert CacheStats.from_dict(d) == m
    assert CacheStats().summary_line() == "expert cache: no queries"
    with pytest.raises(ValueError, match="phase"):
        a.record_step(0, "generate", hits=1, misses=0)
    with pytest.raises(ValueError, match="unknown cache counter"):
        a.add(0, "decode", hitz=1)


# -- traces -------------------------------------------------------------------------------------
def test_trace_round_trip_and_batch_grouping(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, header(n_layers=2, n_experts=8), flush_every=2) as w:
        w.write(TraceRecord("r0", 0, "prefill", 0, (1, 2), (0.75, 0.25), step=0))
        w.write_step(layer=0, phase="prefill", request_ids=["r0", 7], positions=[1, 2],
                     experts=[[2, 3], [4, 1]], weights=[[0.5, 0.5], [0.6, 0.4]], step=0)
        w.write(TraceRecord("r0", 3, "decode", 1, (5, 6), (0.125, 0.875)))
        assert w.records_written == 4
    tr = read_trace(path)
    assert tr.header == TraceHeader("test", 2, 8, 2)
    assert tr.records[1] == TraceRecord("r0", 1, "prefill", 0, (2, 3), (0.5, 0.5), 0)
    assert tr.records[2].request_id == 7 and tr.records[3].step is None
    # One step per token: (1,2) (2,3) (4,1) -> 2 and 1 hit with 4 slots. As a batch: one step of 4.
    assert simulate(tr, 4, "lru").get(layer=0).hits == 2
    s = simulate(tr, 4, "lru", group="batch").get(layer=0)
    assert (s.queries, s.hits, s.misses) == (4, 0, 4)


@pytest.mark.parametrize("lines, line_no, message", [
    (["not json"], 1, "invalid JSON"),
    (['{"family": "x"}'], 1, "not a moerun trace header"),
    (['{"moerun_trace": 2, "family": "x", "n_layers": 1, "n_experts": 4, "k": 1}'], 1, "version 2"),
    (["H", '{"req": 0, "pos": 0, "phase": "decode", "layer": 0, "experts": [1], "weights": [1.0]', "R"], 2,
     "invalid JSON"),
    (["H", "R", '{"req": 0, "pos": 0, "phase": "decode", "layer": 5, "experts": [1], "weights": [1]}'], 3,
     "layer 5 out of range"),
    (["H", '{"req": 0, "pos": 0, "phase": "decode", "layer": 0, "experts": [9], "weights": [1]}'], 2,
     "expert id out of range"),
    (["H", '{"req": 0, "pos": 0, "phase": "decode", "layer": 0, "experts": [1, 1], "weights": [1, 0]}'], 2,
     "repeated expert"),
    (["H", '{"req": 0, "pos": 0, "phase": "decode", "layer": 0, "experts": [1], "weights": []}'], 2,
     "same length"),
    (["H", '{"req": 0, "pos": 0, "phase": "gen", "layer": 0, "experts": [1], "weights": [1]}'], 2, "phase"),
    (["H", '{"req": 0, "pos": "0", "phase": "decode", "layer": 0, "experts": [1], "weights": [1]}'], 2,
     "pos must be an integer"),
    (["H", '{"pos": 0, "phase": "decode", "layer": 0, "experts": [1], "weights": [1]}'], 2, "lacks req"),
    ([], 1, "empty trace"),
])
def test_malformed_traces(tmp_path, lines, line_no, message):
    good = {"H": '{"moerun_trace": 1, "family": "x", "n_layers": 2, "n_experts": 4, "k": 1}',
            "R": '{"req": 0, "pos": 0, "phase": "decode", "layer": 0, "experts": [1], "weights": [1.0]}'}
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(good.get(x, x) for x in lines) + "\n")
    with pytest.raises(TraceFormatError, match=message) as e:
        read_trace(path)
    assert isinstance(e.value, MoerunError) and e.value.line == line_no and f"bad.jsonl:{line_no}:" in str(e.value)


# -- CLI ----------------------------------------------------------------------------------------
@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "zipf.jsonl"
    rng = random.Random(6)
    with TraceWriter(path, header(n_layers=2, n_experts=16)) as w:
        for layer in (0, 1):
            for r in records(zipf_steps(rng, 200, 16, 2), layer=layer):
                w.write(r)
    return path


def test_cli_simulate_table_plot_and_json(trace_file, tmp_path):
    png = tmp_path / "out.png"
    res = CliRunner().invoke(main, ["trace", "simulate", str(trace_file), "--slots", "8,2,4",
                                    "--policy", "lru,belady", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("trace ") and "16 experts, top-2, 400 records" in lines[0]
    assert lines[2].split("|")[1:-1] == [" policy ", " 2 slots ", " 4 slots ", " 8 slots "]
    assert lines[3].startswith("|--") and lines[3].endswith(":|")
    assert lines[4].startswith("| lru ") and lines[5].startswith("| belady ")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = CliRunner().invoke(main, ["trace", "simulate", str(trace_file), "--slots", "4", "--json"])
    out = json.loads(res.stdout)
    rates = {r["policy"]: r["hit_rate"] for r in out["results"]}
    assert set(rates) == {*POLICIES, "belady"} and rates["belady"] == max(rates.values())
    assert rates["lru"] == simulate(read_trace(trace_file), 4, "lru").hit_rate()


def test_cli_errors(trace_file, tmp_path, monkeypatch):
    res = CliRunner().invoke(main, ["trace", "simulate", str(trace_file), "--policy", "lru,fifo"])
    assert res.exit_code == 2 and "unknown policy fifo" in res.output
    res = CliRunner().invoke(main, ["trace", "simulate", str(trace_file), "--slots", "4,x"])
    assert res.exit_code == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    res = CliRunner().invoke(main, ["trace", "simulate", str(bad)])
    assert res.exit_code == 1 and "bad.jsonl:1: invalid JSON" in res.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = CliRunner().invoke(main, ["trace", "simulate", str(trace_file), "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 1 and "pip install matplotlib" in res.output
