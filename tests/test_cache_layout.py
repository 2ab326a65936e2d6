"""Issue 15, item 0: the output does not depend on the expert cache. Slots and scratch buffers hold the layout
experts resident in RAM have (interleaved on page-in), so the kernels sum in the same order whatever the cache
holds: greedy tokens, and every logit, equal with and without a cache of any size, in prefill and decode."""

from __future__ import annotations

import pytest
import torch

from moerun.config import RuntimeConfig, SamplingParams
from moerun.runtime import build

PROMPT = "the quick brown fox jumps over the lazy dog, and then the quick brown fox"


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    """Q4_K_M at a shape the K-quants take (256-wide rows): Q4_K gate/up and Q6_K/Q4_K down, interleavable."""
    pytest.importorskip("moerun.kernels._cpu")
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    spec = preset("tiny-qwen3moe", layers=3, hidden=256, expert_ffn=256, experts=16, experts_used=4)
    return str(make_model(spec, tmp_path_factory.mktemp("layout") / "q4km.gguf", ftype="Q4_K_M", progress=False,
                          threads=1))


def run(path: str, **kw) -> tuple[list[int], torch.Tensor]:
    rt = build(RuntimeConfig(model=path, threads=1, **kw))
    eng = rt.engine
    ids = eng.tokenizer.encode(PROMPT)
    gen = eng.generate(ids, SamplingParams.greedy(max_tokens=24, ignore_eos=True)).run()
    seq = eng.new_sequence()  # the prompt's logits again, in two chunks (prefill), for a bitwise comparison
    logits = torch.cat([eng.model.forward(torch.tensor(ids[:9]), seq.kv), eng.model.forward(torch.tensor(ids[9:]),
                                                                                             seq.kv)])
    rt.close()
    return gen.tokens, logits


def test_greedy_output_does_not_depend_on_the_cache(q4km):
    from moerun.kernels import cpu
    from moerun.loading import load_model

    m = load_model(q4km).model
    assert m.store.get(0, 0).gate.interleave == 8  # resident experts are interleaved (the default --repack)
    assert cpu.can_interleave(load_model(q4km, home="mmap").model.store.get(0, 0).gate)
    ref_tokens, ref_logits = run(q4km)
    for kw in ({"expert_cache_slots": 1}, {"expert_cache_slots": 3}, {"expert_cache_slots": 16},
               {"expert_cache_slots": 3, "cache_prefill": "cache"}, {"expert_cache_mib": 0.5}):
        tokens, logits = run(q4km, **kw)
        assert tokens == ref_tokens, kw
        assert torch.equal(logits, ref_logits), kw


def test_no_repack_keeps_the_files_layout_everywhere(q4km):
    ref = run(q4km, repack=False)
    got = run(q4km, repack=False, expert_cache_slots=2)
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])


def test_slots_hold_the_interleaved_layout(q4km):
    rt = build(RuntimeConfig(model=q4km, threads=1, expert_cache_slots=2))
    cache = rt.engine.expert_cache
    eng = rt.engine
    eng.generate(eng.tokenizer.encode(PROMPT), SamplingParams.greedy(max_tokens=2)).run()
    ex = cache._slot(0, 0)
    assert ex.gate.interleave == 8 and ex.up.interleave == 8
    from moerun.kernels import cpu

    e = next(e for e, s in cache.tables[0].resident.items() if s == 0)
    src = cache.store.get(0, e)  # the file's bytes
    assert torch.equal(cpu.deinterleave(ex.gate).data, src.gate.data)  # the same bytes, in the kernels' order
    rt.close()


@pytest.mark.parametrize("flag,value", [("--expert-cache-slots", "3"), ("--expert-cache-mib", "1.5")])
def test_print_plan_shows_the_cache_that_runs(q4km, flag, value):
    """Issue 15, item 3: with an explicit cache the plan's row names its slots and size, the ones the run uses."""
    import json

    from click.testing import CliRunner

    from moerun.cli import main

    args = ["run", "-m", q4km, "-p", "hello", "-n", "2", "-t", "1", flag, value]
    r = CliRunner().invoke(main, [*args, "--print-plan"], catch_exceptions=False)
    row = next(line for line in r.stderr.splitlines() if line.startswith("cpu "))
    cells = [c.strip() for c in row.split("|")]
    rt = build(RuntimeConfig(model=q4km, threads=1, **{flag[2:].replace("-", "_"): float(value) if "mib" in flag
                                                        else int(value)}))
    slots = {rt.engine.expert_cache.slots(layer) for layer in rt.engine.expert_cache.store.layers}
    assert len(slots) == 1 and cells[4] == f"{slots.pop()} per layer" and cells[5] != "0 B"
    assert "home (disk)" in r.stderr
    from moerun.placement.devices import format_size

    assert cells[5] == format_size(rt.engine.expert_cache.nbytes)
    rt.close()
    out = json.loads(CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False).stdout)
    assert out["expert_cache"]["total"]["all"]["queries"] > 0
