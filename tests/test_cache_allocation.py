"""Expert-cache slots per layer from a trace (moerun.experts.allocate; issue 19, item 2): the allocation is optimal
against brute force on small curves (also where they are not concave), beats an even spread on a trace whose
layers differ in locality, goes through `moerun trace simulate --total-slots` into a plan file, and the runtime
takes the plan (--expert-cache-plan)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from click.testing import CliRunner

from moerun.cli import main
from moerun.experts.allocate import PlanError, allocate, hit_curves, hits_of, read_plan, uniform, write_plan
from moerun.experts.trace import TraceHeader, TraceRecord, TraceWriter


def brute(curves: dict[int, list[int]], total: int) -> int:
    layers = sorted(curves)
    best = 0
    for split in itertools.product(*(range(len(curves[layer])) for layer in layers)):
        if sum(split) <= total:
            best = max(best, sum(curves[layer][s] for layer, s in zip(layers, split)))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_allocation_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    curves = {}
    for layer in range(3):
        steps = [rng.choice([0, 0, 1, 5, 9]) for _ in range(rng.randint(2, 6))]  # steps and plateaus: not concave
        curves[layer] = [sum(steps[:s]) for s in range(len(steps) + 1)]
    total = rng.randint(0, 12)
    plan = allocate(curves, total)
    assert sum(plan.values()) <= total and hits_of(curves, plan) == brute(curves, total)


def write_trace(path, tokens: int = 300, seed: int = 0):
    """Layer 0 keeps to 2 experts, layer 1 cycles through 12, layer 2 draws from 32 at random: top-2 of 32."""
    rng = random.Random(seed)
    with TraceWriter(path, TraceHeader("synthetic", 3, 32, 2)) as w:
        for t in range(tokens):
            for layer, experts in ((0, (t % 2, 1 - t % 2)), (1, (t % 12, (t + 6) % 12)),
                                   (2, tuple(rng.sample(range(32), 2)))):
                w.write(TraceRecord(0, t, "decode", layer, experts, (0.5, 0.5)))
    return path


def test_trace_allocation_beats_uniform_and_goes_through_the_cli(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl")
    from moerun.experts.trace import read_trace

    curves = hit_curves(read_trace(trace), 16)
    even, chosen = uniform(curves, 16), allocate(curves, 16)
    assert chosen[0] == 2 and chosen[1] >= 12 and hits_of(curves, chosen) > 1.3 * hits_of(curves, even)
    plan = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["trace", "simulate", str(trace), "--total-slots", "16", "--allocate", "trace",
                                  "--write-plan", str(plan), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["plans"]["trace"]["hit_rate"] > out["plans"]["uniform"]["hit_rate"]
    assert read_plan(plan) == chosen and json.loads(plan.read_text())["total_slots"] == 16
    text = CliRunner().invoke(main, ["trace", "simulate", str(trace), "--total-slots", "16"]).output
    assert "uniform" in text and "trace" in text and "0:2" in text


def test_the_runtime_takes_a_plan(tmp_path):
    from moerun.config import RuntimeConfig, SamplingParams
    from moerun.runtime import build
    from moerun.tools.make_model import make_model

    model = make_model("tiny-qwen3moe", tmp_path / "m.gguf", progress=False)  # 2 MoE layers of 8 experts
    plan = tmp_path / "plan.json"
    write_plan(plan, {0: 1, 1: 5})
    rt = build(RuntimeConfig(model=str(model), expert_cache_plan=str(plan), threads=1))
    assert rt.cache.slots(0) == 1 and rt.cache.slots(1) == 5
    assert len(rt.engine.generate(rt.engine.tokenizer.encode("hello"), SamplingParams.greedy(max_tokens=4,
                                                                                          ignore_eos=True)).run().tokens) == 4
    rt.close()
    write_plan(plan, {0: 1, 7: 2})
    with pytest.raises(Exception, match="no routed experts"):
        build(RuntimeConfig(model=str(model), expert_cache_plan=str(plan), threads=1))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(PlanError, match="not a cache plan"):
        read_plan(tmp_path / "bad.json")


def test_the_routing_bench_model_is_built_in():
    """`routing` names the shipped routing bench model: 64 experts, top-8, 8 layers, its routing recorded."""
    from moerun.builtin import model_path
    from moerun.config import RuntimeConfig, SamplingParams
    from moerun.runtime import build

    path = model_path("routing")
    assert path.name == "routing-qwen3moe.gguf" and path.is_file()
    r = CliRunner().invoke(main, ["inspect", "routing", "--json"])
    info = json.loads(r.stdout)
    assert (info["experts"], info["experts_used"], info["layers"]) == (64, 8, 8), info
    rt = build(RuntimeConfig(model="routing", threads=1, expert_cache_slots=16))
    gen = rt.engine.generate(rt.engine.tokenizer.encode("def "), SamplingParams.greedy(max_tokens=16,
                                                                                        ignore_eos=True)).run()
    assert len(gen.tokens) == 16 and rt.cache.stats.get(phase="decode").queries > 0
    rt.close()


def test_estimate_replays_each_layer_at_its_own_slots(tmp_path):
    from moerun.placement.costmodel import trace_hit_rates

    path = write_trace(tmp_path / "t.jsonl")
    # layer 0 (2 experts) misses only its first step; layer 1 (a cycle of 12) misses each expert once with 12
    # slots and every time with 2; layer 2 without slots reads every expert from home.
    assert trace_hit_rates(path, [2, 12, 0], 3, "lru") == pytest.approx((598 / 600, 588 / 600, 0.0))
    assert trace_hit_rates(path, [2, 2, 2], 3, "lru")[:2] == pytest.approx((598 / 600, 0.0))


def test_plan_from_a_trace_at_start_keeps_each_stages_total(tmp_path):
    """`--expert-cache-trace`: the slots a cache size gives are re-shared by the trace's curves, within each group
    of layers (a stage's budget); the locality-rich layer gets 2 slots, the cycling one what it needs."""
    from moerun.experts.allocate import plan_from_trace

    trace = write_trace(tmp_path / "t.jsonl")
    plan = plan_from_trace(trace, {0: 6, 1: 6, 2: 6}, 32)
    assert sum(plan.values()) == 18 and plan[0] == 2 and plan[1] >= 12
    split = plan_from_trace(trace, {0: 6, 1: 6, 2: 6}, 32, groups=[[0, 1], [2]])
    assert split == {0: 6, 1: 6, 2: 6}  # layer 1 needs 12 to hit at all: the 4 layer 0 does not use are spread
    split = plan_from_trace(trace, {0: 6, 1: 6, 2: 6}, 32, groups=[[0], [1, 2]])
    assert split[0] == 6 and split[1] + split[2] == 12
    with pytest.raises(PlanError, match="32 experts per layer, this one has 64"):
        plan_from_trace(trace, {0: 6, 1: 6, 2: 6}, 64)


def test_the_runtime_computes_a_plan_from_a_trace(tmp_path):
    """The trace of one run sizes the next run's layers; greedy tokens do not change with the slots."""
    from moerun.config import RuntimeConfig, SamplingParams
    from moerun.runtime import build
    from moerun.tools.make_model import make_model

    model = make_model("tiny-qwen3moe", tmp_path / "m.gguf", progress=False)  # 2 MoE layers of 8 experts
    with TraceWriter(tmp_path / "t.jsonl", TraceHeader("qwen3moe", 2, 8, 2)) as w:
        for t in range(200):  # layer 0 on 2 experts, layer 1 cycling through 6
            w.write(TraceRecord(0, t, "decode", 0, (0, 1), (0.5, 0.5)))
            w.write(TraceRecord(0, t, "decode", 1, (t % 6, (t + 3) % 6), (0.5, 0.5)))
    params = SamplingParams.greedy(max_tokens=6, ignore_eos=True)
    tokens = {}
    trace = {"expert_cache_trace": str(tmp_path / "t.jsonl")}
    for name, extra in (("even", {}), ("trace", trace), ("stand-in", {**trace, "devices": ("standin:0",)})):
        rt = build(RuntimeConfig(model=str(model), expert_cache_slots=4, threads=1, **extra))
        tokens[name] = rt.engine.generate(rt.engine.tokenizer.encode("hello"), params).run().tokens
        if name != "even":  # the plan itself is re-shared: the CPU cache, a device's cache and --print-plan agree
            assert (rt.cache.slots(0), rt.cache.slots(1)) == (2, 6)
            assert [s for d in rt.plan.devices for s in d.expert_slots] == [2, 6]
        rt.close()
    assert tokens["trace"] == tokens["even"] == tokens["stand-in"]
    with pytest.raises(ValueError, match="give one of them"):
        RuntimeConfig(model=str(model), expert_cache_trace=str(tmp_path / "t.jsonl"))
    r = CliRunner().invoke(main, ["run", "-m", str(model), "-p", "x", "-n", "2", "--expert-cache-slots", "4",
                                  "--expert-cache-trace", str(write_trace(tmp_path / "other.jsonl"))])
    assert r.exit_code != 0 and "32 experts" in r.output and "Traceback" not in r.output


def test_estimate_replays_prompts_only_for_a_cache_that_takes_them(tmp_path):
    """The runtime's cache lets prefill bypass it (the default), so the replay must not warm it with the prompt:
    decode's first step on the prompt's experts is a miss unless prefill is cached too."""
    from moerun.placement.costmodel import trace_hit_rates

    with TraceWriter(tmp_path / "p.jsonl", TraceHeader("synthetic", 1, 8, 2)) as w:
        for t in range(4):
            w.write(TraceRecord(0, t, "prefill", 0, (2, 3), (0.5, 0.5)))
        for t in range(4, 8):
            w.write(TraceRecord(0, t, "decode", 0, (2, 3), (0.5, 0.5)))
    assert trace_hit_rates(tmp_path / "p.jsonl", [2], 1, "lru") == pytest.approx((6 / 8,))
    assert trace_hit_rates(tmp_path / "p.jsonl", [2], 1, "lru", prefill=True) == pytest.approx((1.0,))


def test_the_guarded_allocation_keeps_to_uniform_where_layers_are_alike(tmp_path):
    """Layers drawn alike (top-2 of 16 at random, 8 requests): an exact fit to one trace is noise, the halves
    disagree, and the even spread is kept; with layers that differ the trace's allocation is kept."""
    from moerun.experts.allocate import guarded_allocate

    rng = random.Random(3)
    alike = [TraceRecord(q, t, "decode", layer, tuple(rng.sample(range(16), 2)), (0.5, 0.5))
             for q in range(8) for t in range(40) for layer in range(3)]
    plan, gain = guarded_allocate(alike, 18, 16, 2)
    assert gain <= 0 and plan == uniform(range(3), 18)
    from moerun.experts.trace import read_trace

    differ = read_trace(write_trace(tmp_path / "t.jsonl")).records  # one request: halves in time
    plan, gain = guarded_allocate(differ, 16, 32, 2)
    assert gain > 0 and plan == allocate(hit_curves(differ, 16), 16, 2)
