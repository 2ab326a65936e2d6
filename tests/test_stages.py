"""Layers split into stages in one process (--devices cpu,cpu): the same logits and greedy tokens as one stage,
for every family and split point; expert-cache statistics per stage that add up to the totals."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from click.testing import CliRunner
from hf_models import FAMILIES

from moerun.cli import main
from moerun.config import RuntimeConfig, SamplingParams
from moerun.engine.kv_cache import KVPool, SeqKV
from moerun.engine.pipeline import Stage, StagedModel
from moerun.experts.stats import PHASES
from moerun.loading import load_model
from moerun.runtime import build

CPU = torch.device("cpu")
LAYERS = 5


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """family -> a 5-layer quantized GGUF of the family's tiny preset (the C kernels and the fused decode path)."""
    from moerun.tools.make_model import make_model
    from moerun.tools.presets import preset

    root, out = tmp_path_factory.mktemp("stages"), {}

    def get(family: str):
        if family not in out:
            out[family] = make_model(preset(f"tiny-{family}", layers=LAYERS), root / f"{family}.gguf",
                                     ftype="Q8_0", progress=False, threads=1)
        return out[family]

    return get


def split_by_cuts(model, cuts: list[int]) -> StagedModel:
    bounds = [0, *cuts, model.spec.n_layers]
    return StagedModel([Stage(model.slice(a, b)) for a, b in itertools.pairwise(bounds)])


def generate(model, prompt: torch.Tensor, n: int, pool: KVPool) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and every step's logits: prefill in two chunks, then decode two sequences together
    (the prompt, and the prompt's first half) so both forward and the batched decode are covered."""
    a, b = SeqKV(pool, 256), SeqKV(pool, 256)
    half = len(prompt) // 2
    logits = [model.forward(prompt[:half], a), model.forward(prompt[half:], a, last_only=True),
              model.forward(prompt[:half], b, last_only=True)]
    toks = [int(logits[1][-1].argmax()), int(logits[2][-1].argmax())]
    out = []
    for _ in range(n):
        out.append(toks[0])
        step = model.decode(torch.tensor(toks), [a, b])
        logits.append(step)
        toks = [int(t) for t in step.argmax(-1)]
    return out, logits


@pytest.mark.parametrize("family", FAMILIES)
def test_two_cpu_stages_equal_one_stage_gguf(gguf, tokens32, family):
    loaded = load_model(gguf(family))
    model = loaded.model
    ref_tokens, ref_logits = generate(model, tokens32 % model.spec.vocab, 8, KVPool(model.spec, 512))
    for cuts in ([1], [3], [4], [0], [LAYERS], [1, 2, 4]):
        staged = split_by_cuts(model, cuts)
        toks, logits = generate(staged, tokens32 % model.spec.vocab, 8, KVPool(model.spec, 512))
        assert toks == ref_tokens, (family, cuts)
        for got, ref in zip(logits, ref_logits):
            assert torch.equal(got, ref), (family, cuts, (got - ref).abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_two_cpu_stages_equal_one_stage_hf(hf_model, tokens32, family):
    _, folder = hf_model(family)
    model = load_model(folder).model
    ref = model.forward(tokens32)
    for cut in (0, 1, 2):
        assert torch.equal(split_by_cuts(model, [cut]).forward(tokens32), ref), (family, cut)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", [(3, 1), (1, 3), (1, 1, 1)], ids=["3-1", "1-3", "1-1-1"])
def test_devices_and_tensor_split_greedy_output(gguf, family, split):
    """Through build(): the plan's split (uneven --tensor-split), per-stage caches, the engine's sampling."""
    path = str(gguf(family))
    params = SamplingParams.greedy(max_tokens=12, ignore_eos=True)

    def run(**cfg):
        rt = build(RuntimeConfig(model=path, threads=1, expert_cache_slots=3, **cfg))
        gen = rt.engine.generate(rt.engine.tokenizer.encode("The cache holds experts"), params).run()
        return rt, gen.tokens

    one, ref = run()
    rt, toks = run(devices=("cpu",) * len(split), tensor_split=split)
    assert toks == ref and len(toks) == 12
    ranges = [d.layers for d in rt.plan.devices]
    total = sum(split)
    assert ranges[0][0] == 0 and ranges[-1][1] == LAYERS and len(ranges) == len(split)
    assert [b - a for a, b in ranges] == [round(LAYERS * sum(split[:k + 1]) / total) -
                                         round(LAYERS * sum(split[:k]) / total) for k in range(len(split))]
    assert [st.layers for st in rt.stages] == ranges
    check_stage_stats(rt, one)


def counts(stats, layer, phase):
    c = stats.get(layer, phase)
    return c.queries, c.hits, c.misses, c.evictions, c.bytes_paged_in


def check_stage_stats(rt, one) -> None:
    """Each stage's cache counts its own layers only, the stages add up to the total, and the total equals
    the one-stage run's layer by layer (same routing, same slots per layer)."""
    stages = rt.stage_stats()
    assert len(stages) == len(rt.stages) > 1
    for (label, stats), st in zip(stages, rt.stages):
        assert set(stats.layers()) <= set(range(*st.layers)) and str(st.layers[0]) in label
        assert st.cache is not None and st.cache.stats is not one.cache.stats
    for layer in range(LAYERS):
        for phase in PHASES:
            per_stage = [counts(s, layer, phase) for _, s in stages]
            summed = tuple(map(sum, zip(*per_stage)))
            assert summed == counts(rt.cache.stats, layer, phase) == counts(one.cache.stats, layer, phase)
            assert sum(1 for c in per_stage if any(c)) <= 1  # a layer belongs to one stage
    assert rt.cache.stats.get(phase="decode").queries > 0
    rt.cache.stats.reset()  # resetting the total resets every stage
    assert all(st.cache.stats.get().queries == 0 for st in rt.stages)


def test_cli_devices_reports_each_stage(gguf):
    args = ["run", "-m", str(gguf("qwen3moe")), "-p", "Hello", "-n", "8", "--temp", "0", "--ignore-eos", "-t", "1",
            "--expert-cache-slots", "2"]
    one = json.loads(CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False).stdout)
    two = json.loads(CliRunner().invoke(main, [*args, "--json", "--devices", "cpu,cpu", "--tensor-split", "2,3"],
                                        catch_exceptions=False).stdout)
    assert two["tokens"] == one["tokens"] and "expert_cache_stages" not in one
    stages = two["expert_cache_stages"]
    assert [s["stage"] for s in stages] == ["stage 0 (cpu, layers 0-1)", "stage 1 (cpu, layers 2-4)"]
    for key in ("queries", "hits", "misses", "bytes_paged_in"):
        for phase in PHASES:
            total = two["expert_cache"]["total"][phase][key]
            assert total == sum(s["total"][phase][key] for s in stages) == one["expert_cache"]["total"][phase][key]
    r = CliRunner().invoke(main, [*args, "--devices", "cpu,cpu", "--print-plan"], catch_exceptions=False)
    assert r.exit_code == 0
    lines = r.stderr.splitlines()
    assert sum(line.startswith("cpu ") for line in lines) == 2  # the plan: one row per stage
    assert any(line.startswith("expert cache, stage 0 (cpu, layers 0-1): ") for line in lines)
    assert any(line.startswith("expert cache, stage 1 (cpu, layers 2-4): ") for line in lines)
    assert any(line.startswith(("expert cache: decode hit rate", "expert cache: prefill"))
               for line in lines)


@pytest.mark.parametrize("kw,phrase", [
    ({"devices": ("cpu", "cuda:0")}, "of one kind"),
    ({"devices": ("cpu", "gpu0")}, "unknown device 'gpu0'"),
    ({"miss_path": "never"}, "miss_path"),
    ({"devices": ("cpu", "cpu"), "tensor_split": (1.0,)}, "2 non-negative proportions"),
    ({"tensor_split": (1.0, 1.0)}, "1 non-negative proportions"),
    ({"pipeline_world_size": 2, "pipeline_rank": 2}, "pipeline rank"),
    ({"pipeline_world_size": 2, "devices": ("cpu", "cpu")}, "one stage per process"),
    ({"master_port": 0}, "master_port"),
    ({"pipeline_timeout": 0}, "pipeline_timeout"),
])
def test_runtime_config_rejects(kw, phrase):
    with pytest.raises(ValueError, match=phrase):
        RuntimeConfig(**kw)


def test_stages_must_cover_the_layers(gguf):
    model = load_model(gguf("olmoe")).model
    with pytest.raises(ValueError, match="do not cover"):
        StagedModel([Stage(model.slice(0, 2)), Stage(model.slice(3, LAYERS))])
