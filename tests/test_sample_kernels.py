"""The sampler's C passes (csrc/sample.c) against their torch twins (moerun.kernels.sample) and across kernel sets:
the same bits and the same tokens, so a CPU run gives the same tokens with MOERUN_KERNELS=off."""

from __future__ import annotations

import math

import pytest
import torch

import moerun.kernels.sample as S
from moerun.config import SamplingParams
from moerun.engine.sampler import Sampler
from moerun.kernels import cpu

pytestmark = [pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built"),
              pytest.mark.usefixtures("one_torch_thread")]
V = 248320
NO_HISTORY = torch.zeros(0, dtype=torch.long)


def isas() -> list[int]:
    return [cpu.ISA_IDS[name] for name in cpu.features()["isas"]]


def test_exp32_is_the_twins_on_every_kernel_set():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-70, 0, 400_001), -torch.rand(200_000, generator=g) * 80,
                   torch.tensor([-math.inf, 0.0, -64.0, -63.99999, -1e-30])])
    want = S.exp32(x)
    for isa in isas():
        got = torch.empty_like(x)
        cpu._cpu.sample_exp(isa, x.data_ptr(), x.numel(), got.data_ptr())
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), isa
    inside = x > -60
    rel = ((want.double() - x.double().exp()).abs() / x.double().exp())[inside]
    assert float(rel.max()) < 2e-7


@pytest.mark.parametrize("n", [300_000, V, 1000, 40, 1])  # 300,000: past the draw's stack blocks
def test_draw_and_norm_are_the_twins_on_every_kernel_set(n, monkeypatch):
    g = torch.Generator().manual_seed(n)
    for scale in (0.3, 1.0, 4.0):
        x = torch.randn(n, generator=g) * scale
        if n > 100:
            x[torch.randperm(n, generator=g)[: n // 3]] = -math.inf
        x[0] = 2.0 * scale
        for cut in (-math.inf, 0.1 * scale):
            us = torch.rand(8, dtype=torch.float64, generator=g)
            for u in us:
                u = u.view(1)
                got = {cpu._cpu.sample_draw(isa, x.data_ptr(), n, S.f32(0.8), cut, float(u)) for isa in isas()}
                monkeypatch.setattr(S, "available", lambda t: False)
                twin = int(S.draw(x, S.f32(0.8), u, cut))
                monkeypatch.undo()
                assert got == {twin}, (scale, cut, float(u))
        mx = float(x.max())
        sums = {cpu._cpu.sample_norm(isa, x.data_ptr(), n, mx) for isa in isas()}
        assert len(sums) == 1 and S.f32(sums.pop()) == float(S.block_sums(S.exp32(x - mx)).cumsum(0)[-1].float())


def test_the_cut_is_the_same_on_every_kernel_set():
    g = torch.Generator().manual_seed(3)
    bufs = S.CutBuffers()
    for scale in (0.3, 1.0, 3.0):
        x = torch.randn(V, generator=g) * scale
        for tp, lmp in ((0.95, None), (0.9, math.log(0.05)), (None, math.log(0.01))):
            tp32 = S.f32(tp) if tp else 0.0
            lm32 = S.f32(lmp) if lmp else 0.0
            got = {cpu._cpu.sample_cut(isa, x.data_ptr(), V, tp32, tp is not None, lm32, lmp is not None,
                                       bufs.hist.data_ptr(), bufs.keys.data_ptr(), S.CUT_CAP) for isa in isas()}
            assert len(got) == 1


SETTINGS = [
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.0},
    {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "min_p": 0.0},
    {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 1.2, "top_k": 300, "top_p": 0.9, "min_p": 0.01},
]


@pytest.mark.parametrize("kw", SETTINGS)
def test_kernels_off_gives_the_same_tokens(kw, monkeypatch):
    """The torch twin (MOERUN_KERNELS=off's path) draws the C path's tokens from the same generator states."""
    g = torch.Generator().manual_seed(5)
    for x in (torch.randn(V, generator=g), torch.randn(V, generator=g) * 0.3, torch.randn(V, generator=g) * 3):
        params = SamplingParams(seed=17, **kw)
        c, twin = Sampler(params, V), Sampler(params, V)
        for _ in range(3):
            a = int(c.sample(x, NO_HISTORY))
            monkeypatch.setattr(S, "available", lambda t: False)
            b = int(twin.sample(x, NO_HISTORY))
            monkeypatch.undo()
            assert a == b, kw
            assert torch.equal(c.generator.get_state(), twin.generator.get_state())


@pytest.mark.parametrize("n", [1, 15, 16, 17, 2047, 2048, 2049, 4113, V])  # lanes, chunks and their tails
def test_argmax_is_torchs_on_every_kernel_set(n):
    """Greedy's one C pass: torch.argmax's index (the first of equal largest values, -0.0 equal to +0.0, infinities
    ordered) on every kernel set, and -1 wherever a NaN is, including a NaN below the largest value."""
    g = torch.Generator().manual_seed(n)
    cases = [torch.randn(n, generator=g), torch.randint(-3, 3, (n,), generator=g).float(),  # many ties
             torch.full((n,), -math.inf), torch.zeros(n)]
    neg_zero_first = torch.full((n,), -1.0)  # -0.0 before +0.0 (in another chunk when n allows): the -0.0 wins
    neg_zero_first[n // 3] = -0.0
    neg_zero_first[-1] = 0.0
    cases.append(neg_zero_first)
    with_inf = torch.randn(n, generator=g)
    with_inf[n // 2] = math.inf
    with_inf[-1] = math.inf
    cases.append(with_inf)
    late = torch.randn(n, generator=g)
    late[-1] = 100.0  # the largest in the last chunk's tail
    cases.append(late)
    for x in cases:
        want = int(torch.argmax(x))
        for isa in isas():
            assert cpu._cpu.sample_argmax(isa, x.data_ptr(), n) == want, (isa, n)
        for at in {0, n // 2, n - 1}:
            bad = x.clone()
            bad[at] = math.nan
            for isa in isas():
                assert cpu._cpu.sample_argmax(isa, bad.data_ptr(), n) == -1, (isa, n, at)
            neg_nan = x.clone()
            neg_nan.view(torch.int32)[at] = -0x400000  # a NaN with the sign bit set (0xffc00000)
            assert S.argmax(neg_nan) == -1


def test_greedy_sample_takes_the_c_pass_and_equals_the_twin(monkeypatch):
    """A greedy Sampler without penalties picks by S.argmax; with the kernels off, the same token by torch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(V, generator=g)
    x[7], x[V - 5] = 9.0, 9.0
    s = Sampler(SamplingParams(temperature=0.0), V)
    calls = []
    real = S.argmax
    monkeypatch.setattr(S, "argmax", lambda t: calls.append(1) or real(t))
    assert int(s.sample(x, NO_HISTORY)) == 7 and calls
    monkeypatch.setattr(S, "available", lambda t: False)
    assert int(s.sample(x, NO_HISTORY)) == 7
    x[100] = math.nan
    assert int(s.sample(x, NO_HISTORY)) == -1
