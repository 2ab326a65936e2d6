"""Speculative decoding (issue 20): prompt lookup and draft models keep the target's output, greedy and
sampled; the draft length chooser; the settings' validation."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from family_checks import check_speculative
from hf_models import FAMILIES

from moerun.config import DraftParams, SamplingParams
from moerun.engine.engine import Engine
from moerun.engine.speculative import DraftLength, LookupDrafter, ModelDrafter
from moerun.loading import load_model
from moerun.text import Tokenizer
from moerun.tools.convert import convert_hf_to_gguf


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_keep_the_greedy_and_the_seeded_output(hf_model, family, tmp_path):
    _, folder = hf_model(family)
    path = tmp_path / f"{family}.gguf"
    convert_hf_to_gguf(folder, path)
    check_speculative(str(path))


def test_lookup_drafts_what_followed_the_latest_match():
    d = LookupDrafter(3)
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4]
    assert d.propose(ctx, 2) == [7, 8]  # the latest earlier "2 3 4" was followed by 7 8
    assert d.propose([5, 6, 1, 2, 9, 6, 1], 4) == [2, 9, 6, 1]  # "6 1" matched; the draft runs to the end
    assert d.propose([1, 2, 3], 4) == []  # nothing repeats
    assert d.propose([4, 1, 4], 3) == [1, 4]  # a 1-gram match when no longer one repeats
    assert d.propose([4, 1, 4], 0) == []


def test_draft_length_follows_acceptance_and_cost():
    def cost(rows):  # each row adds half a step
        return 1.0 + 0.5 * (rows - 1)

    good = DraftLength(8, cost)
    for _ in range(30):
        n = good.choose(8)
        good.record(n, n, n, cost(n + 1) * 1e-3)  # every draft accepted
    assert good.choose(8) == 8
    bad = DraftLength(8, cost)
    for _ in range(30):
        n = bad.choose(8)
        bad.record(n, n, 0, cost(n + 1) * 1e-3)  # none accepted
    chosen = []
    for _ in range(200):
        chosen.append(bad.choose(8))
        if chosen[-1]:
            bad.record(chosen[-1], chosen[-1], 0, cost(chosen[-1] + 1) * 1e-3)
    probes = [i for i, n in enumerate(chosen) if n]
    assert 2 <= len(probes) <= 6  # it stops drafting, and asks again less and less often
    assert all(b - a >= DraftLength.PROBE for a, b in pairwise(probes))
    assert good.choose(3) == 3 and bad.choose(0) == 0  # never past what the caller allows
    # expected tokens per step, 1 + d (S(1) + S(2) + ...): the prior halves the chain's survival at each depth
    assert math.isclose(DraftLength(4).expected(2), 1.0 + 0.5 + 0.25)  # d's prior is 1
    bursty = DraftLength(8, cost)
    for _ in range(40):  # chains that get past the first draft go to the end
        bursty.record(8, 8, 0, 1e-3)
        bursty.record(8, 8, 8, 3e-3)
    assert bursty.survival(8)[0] < 0.6 and bursty.survival(8)[-1] > 0.45


def test_speculative_sampling_keeps_the_target_distribution(hf_model):
    """Chi-square: the third generated token's frequencies over many seeds, drafts from the model itself (kept
    with the target's probability), against its exact distribution, summed over the first two tokens."""
    _, folder = hf_model("qwen3moe")
    loaded = load_model(folder)
    tok = Tokenizer.from_model_file(loaded.file)
    target = Engine(loaded.model, tok, ctx_size=64)
    draft = Engine(load_model(folder).model, tok, ctx_size=64)
    spec = Engine(loaded.model, tok, ctx_size=64, drafter=ModelDrafter(draft),
                  draft=DraftParams(draft_p_min=0.0, draft_max=4, adaptive=False))
    prompt, k = [5, 17, 300, 42], 4
    p = {"temperature": 1.0, "top_k": k, "top_p": 1.0, "min_p": 0.0, "max_tokens": 3, "ignore_eos": True}

    def dist(ctx):  # the sampler's distribution: top-k then softmax at temperature 1
        logits = loaded.model.forward(torch.tensor(ctx))[-1]
        v, i = logits.topk(k)
        return dict(zip(i.tolist(), torch.softmax(v, 0).tolist()))

    expected: dict[int, float] = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist(prompt + [a]).items():
            for c, pc in dist(prompt + [a, b]).items():
                expected[c] = expected.get(c, 0.0) + pa * pb * pc
    seq = spec.new_sequence()
    runs, counts, drafted, kept = 3000, {}, 0, 0
    for seed in range(runs):
        g = spec.generate(prompt, SamplingParams(seed=seed, **p), seq).run()
        counts[g.tokens[2]] = counts.get(g.tokens[2], 0) + 1
        drafted, kept = drafted + g.timings.draft_n, kept + g.timings.draft_n_accepted
    assert 0 < kept < drafted  # drafts both kept and rejected
    # cells of at least 5 expected draws; the rest pooled
    big = [c for c, q in expected.items() if q * runs >= 5]
    obs = [counts.get(c, 0) for c in big] + [runs - sum(counts.get(c, 0) for c in big)]
    exp = [expected[c] * runs for c in big] + [runs * (1 - sum(expected[c] for c in big))]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len([e for e in exp if e > 0]) - 1
    # the 99.9% quantile of chi-square (Wilson-Hilferty): a correct sampler fails 1 run in 1000
    z = 3.09
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, (chi2, crit, df)
    # the same seeds without drafts give the same tokens
    plain = target.generate(prompt, SamplingParams(seed=7, **p)).run().tokens
    assert spec.generate(prompt, SamplingParams(seed=7, **p), seq).run().tokens == plain


def test_draft_settings_are_checked():
    with pytest.raises(ValueError, match="draft_min"):
        DraftParams(draft_max=2, draft_min=3)
    with pytest.raises(ValueError, match="draft_p_min"):
        DraftParams(draft_p_min=1.5)
    with pytest.raises(ValueError, match="lookup_ngram"):
        DraftParams(lookup_ngram=-1)
    assert DraftParams(draft_max=64).rows == 15


def test_the_device_stand_in_gives_the_cpu_tokens_with_drafts_and_f16_kv():
    """The GPU code path (the CPU standing in for a device, moerun.device) with prompt lookup and an f16 cache:
    the CPU's plain greedy tokens."""
    from moerun.config import RuntimeConfig
    from moerun.runtime import build

    def tokens(**kw):
        rt = build(RuntimeConfig(threads=1, repack=False, **kw))
        eng = rt.engine
        ids = eng.tokenizer.encode("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib(")
        gen = eng.generate(ids, SamplingParams.greedy(max_tokens=24, ignore_eos=True)).run()
        rt.close()
        return gen.tokens, gen.timings

    ref, _ = tokens()
    got, t = tokens(devices=("standin:0",), expert_cache_slots=2, cache_type_k="f16", cache_type_v="f16",
                    draft=DraftParams(lookup_ngram=2, adaptive=False))
    assert got == ref and t.draft_n > 0
