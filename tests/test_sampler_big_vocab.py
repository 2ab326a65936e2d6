"""The sampler's CPU shortcut at a real vocabulary (248,320, Qwen3.5's): the same tokens, drawn from the same
random numbers, as the plain chain (Sampler(fast=False)), for top-p / min-p without top-k; with every truncation
off there is no shortcut (the chain sorts nothing). The undecided cases go the plain way with the generator as it
was. No timing is asserted."""

from __future__ import annotations

import pytest
import torch

import moerun.kernels.sample as sample_mod
from moerun.config import SamplingParams
from moerun.engine.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 248320
NO_HISTORY = torch.zeros(0, dtype=torch.long)


def logits(kind: str, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g)
    if kind == "flat":  # random weights' logits: top-p 0.95 keeps most of the vocabulary
        return x
    if kind == "wide":
        return x * 3
    if kind == "peaked":  # a few clear favourites over a long tail, as a trained model's
        x = x * 2
        x[torch.randperm(vocab, generator=g)[:20]] += 12
        return x
    if kind == "dominant":  # one token of p ~0.9 over a flat tail: top-p 0.95 reaches deep into the tail
        x[5] = 13.0
        return x
    if kind == "masked":  # a grammar's mask: -inf on most tokens
        x[torch.randperm(vocab, generator=g)[: vocab // 2]] = -float("inf")
        return x
    raise ValueError(kind)


class Spy:
    """Counts the shortcut's undecided steps (None: the plain chain took the step)."""

    def __init__(self, sampler: Sampler):
        self.steps = self.undecided = 0
        inner = sampler._fast_cut

        def wrapped(vals):
            got = inner(vals)
            self.steps += 1
            self.undecided += got is None
            return got

        sampler._fast_cut = wrapped


def same_tokens(params: SamplingParams, x: torch.Tensor, n: int, history=NO_HISTORY, shortcut: bool = True) -> Spy:
    """n tokens from the shortcut and from the plain chain, same seed: equal tokens and generator states."""
    fast = Sampler(params, x.numel())
    plain = Sampler(params, x.numel(), fast=False)
    assert fast._fast == shortcut and not plain._fast
    spy = Spy(fast)
    for step in range(n):
        a, b = fast.sample(x, history), plain.sample(x, history)
        assert a.dim() == 0 and a.dtype == torch.long
        assert int(a) == int(b), (params, step)
        assert torch.equal(fast.generator.get_state(), plain.generator.get_state()), (params, step)
    return spy


TRUNCATED = [
    {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "min_p": 0.0},
    {"temperature": 1.3, "top_k": 0, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 0.5, "top_k": 0, "top_p": 1.0, "min_p": 0.001},
    {"temperature": 1.0, "top_k": 0, "top_p": 0.999, "min_p": 0.0},
]


@pytest.mark.parametrize("kind", ["flat", "wide", "peaked", "dominant", "masked"])
def test_top_p_and_min_p_without_top_k_draw_the_plain_chains_tokens(kind):
    x = logits(kind)
    decided = steps = 0
    for i, kw in enumerate(TRUNCATED):
        spy = same_tokens(SamplingParams(seed=11 + i, **kw), x, 4)
        decided, steps = decided + spy.steps - spy.undecided, steps + spy.steps
    assert decided >= 0.75 * steps  # the shortcut decides nearly every step (undecided: a rare near-tie)


@pytest.mark.parametrize("kind", ["flat", "peaked", "masked"])
def test_every_truncation_off_needs_no_shortcut(kind):
    spy = same_tokens(SamplingParams(seed=3, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0), logits(kind), 8,
                      shortcut=False)
    assert spy.steps == 0


def test_penalties_then_the_shortcut():
    x = logits("flat")
    history = torch.randint(0, V, (200,), generator=torch.Generator().manual_seed(1))
    history = torch.cat([history, history[:50]])  # repeats
    params = SamplingParams(seed=5, temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, repeat_penalty=1.3,
                            frequency_penalty=0.2, repeat_last_n=-1)
    same_tokens(params, x, 4, history)


@pytest.mark.parametrize("vocab", [151936, 100003, 32768])  # blocks and buckets that end part-way
def test_other_vocabularies(vocab):
    x = logits("flat", vocab, seed=2)
    for kw in TRUNCATED:
        same_tokens(SamplingParams(seed=9, **kw), x, 3)


def test_undecided_steps_leave_the_generator_as_it_was(monkeypatch):
    """With every cut left undecided, each step goes the plain way: the tokens and the generator still follow the
    plain chain."""
    monkeypatch.setattr(sample_mod, "cut", lambda *a: None)
    for kw in (TRUNCATED[0], TRUNCATED[3]):
        spy = same_tokens(SamplingParams(seed=4, **kw), logits("flat"), 2)
        assert spy.undecided == spy.steps == 2


def test_ties_and_non_finite_logits_go_the_plain_way():
    tied = torch.zeros(V)  # every logit equal: the order among them is topk's
    spy = same_tokens(SamplingParams(seed=1, temperature=0.8, top_k=0, top_p=0.95, min_p=0.0), tied, 3)
    assert spy.undecided == 3
    x = logits("flat")
    x[7] = float("inf")
    spy = same_tokens(SamplingParams(seed=1, temperature=0.8, top_k=0, top_p=0.95, min_p=0.0), x, 2)
    assert spy.undecided == 2


def test_the_shortcut_applies_only_where_it_is_exact():
    assert not Sampler(SamplingParams(top_k=40), V)._fast  # top-k: one small topk already
    assert not Sampler(SamplingParams(top_k=0, top_p=1.0, min_p=0.0), V)._fast  # nothing to sort
    assert not Sampler(SamplingParams.greedy(), V)._fast
    assert not Sampler(SamplingParams(top_k=0), 32767)._fast  # small vocabularies: sorting is cheap
    assert Sampler(SamplingParams(top_k=0), 32768)._fast
    assert Sampler(SamplingParams(top_k=0), V)._fast
    assert not Sampler(SamplingParams(top_k=0), V, fast=False)._fast
    # probs() is the plain chain's: what the shortcut draws from
    x = logits("peaked")
    params = SamplingParams(seed=0, temperature=0.8, top_k=0, top_p=0.95, min_p=0.0)
    assert torch.equal(Sampler(params, V).probs(x, NO_HISTORY), Sampler(params, V, fast=False).probs(x, NO_HISTORY))
