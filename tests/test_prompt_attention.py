"""A prompt's attention in C (moerun.kernels.cpu.attend_prompt) against softmax attention written out in float64."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference

from moerun.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built")

ISAS = [i for i in ("scalar", "avx512vnni") if cpu.available() and i in cpu.features()["isas"]]


CASES = [  # T, cached prefix, heads, KV heads, D, Dv, window, sinks
    (70, 0, 8, 2, 64, 64, 0, False),
    (129, 37, 4, 4, 128, 128, 0, False),
    (300, 0, 8, 1, 64, 64, 50, True),
    (40, 500, 16, 4, 128, 128, 0, True),
    (33, 0, 4, 1, 192, 128, 0, False),  # D != Dv (MLA-like)
    (17, 3, 2, 1, 16, 16, 5, False),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-P{}-h{}-kv{}-D{}-Dv{}-w{}-s{}".format(*c))
def test_matches_softmax_attention(isa, case):
    T, P, nh, nkv, D, Dv, window, sink = case
    g = torch.Generator().manual_seed(T * 31 + P)
    S = P + T
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((T, nh, D), (S, nkv, D), (S, nkv, Dv)))
    q_pos, k_pos = torch.arange(P, P + T), torch.arange(S)
    sinks = torch.randn(nh, generator=g) if sink else None
    out = cpu.attend_prompt(q, k, v, q_pos, k_pos, D ** -0.5, sinks, window, isa=isa)
    ref = reference(q, k, v, q_pos, k_pos, D ** -0.5, sinks, window)
    assert out.shape == (T, nh * Dv)
    assert torch.allclose(out.double(), ref, atol=2e-5, rtol=1e-4), (out.double() - ref).abs().max()


def test_gaps_in_the_key_positions_follow_positions_not_indices():
    """A ring or a chunked cache hands keys with positions that skip: visibility is by position."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(20, 4, 32, generator=g), torch.randn(30, 2, 32, generator=g), torch.randn(30, 2, 32, generator=g)
    k_pos = torch.arange(30) * 2
    q_pos = torch.arange(20) * 3 + 1
    for isa in ISAS:
        out = cpu.attend_prompt(q, k, v, q_pos, k_pos, 0.2, None, 7, isa=isa)
        assert torch.allclose(out.double(), reference(q, k, v, q_pos, k_pos, 0.2, None, 7), atol=2e-5)


def test_the_thread_count_does_not_change_the_result():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(200, 8, 64, generator=g), torch.randn(200, 2, 64, generator=g), torch.randn(200, 2, 64, generator=g)
    pos = torch.arange(200)
    before = cpu.get_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            cpu.set_threads(n)
            outs.append(cpu.attend_prompt(q, k, v, pos, pos, 0.125))
    finally:
        cpu.set_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("bad", ["kv-heads", "dv", "descending", "dtype"])
def test_bad_shapes_are_errors(bad):
    q, k, v, pos = torch.randn(20, 4, 32), torch.randn(20, 2, 32), torch.randn(20, 2, 32), torch.arange(20)
    if bad == "kv-heads":
        k, v = torch.randn(20, 3, 32), torch.randn(20, 3, 32)
    elif bad == "dv":
        v = torch.randn(20, 2, 24)
    elif bad == "descending":
        pos = pos.flip(0)
    else:
        q = q.double()
    with pytest.raises(ValueError):
        cpu.attend_prompt(q, k, v, torch.arange(20), pos, 0.1)
