"""moerun.kernels.delta.delta_prompt (csrc/deltanet_prompt.c: a prompt chunk's delta rule by the recurrence, in C)
against moerun.model.deltanet.delta_steps, the torch recurrence, on every kernel set this CPU runs."""

from __future__ import annotations

import pytest
import torch

from moerun.kernels import cpu
from moerun.model import deltanet

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C kernels are not built")
ISAS = cpu.features()["isas"]


def inputs(T: int, nk: int = 2, nv: int = 4, dk: int = 16, dv: int = 32, decay: float = 2.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = 2 * torch.randn(T, nk, dk, generator=g), 2 * torch.randn(T, nk, dk, generator=g)
    v = torch.randn(T, nv, dv, generator=g)
    log_decay = -decay * torch.rand(T, nv, generator=g)  # [T, nv]
    beta = torch.rand(T, nv, generator=g)
    state = 0.1 * torch.randn(nv, dk, dv, generator=g)
    return q, k, v, log_decay, beta, state


def check(q, k, v, g, beta, state, order, isa, atol=1e-5):
    from moerun.kernels import delta

    o_ref, s_ref = deltanet.delta_steps(q, k, v, g, beta, state.clone(), order)
    s = state.clone()
    o = delta.delta_prompt(q, k, v, g, beta, s, order, isa=isa)
    assert o.shape == o_ref.shape
    assert (o - o_ref).abs().max() < atol and (s - s_ref).abs().max() < atol


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 7, 64, 65, 200])
@pytest.mark.parametrize("order", ["grouped", "tiled"])
@pytest.mark.parametrize("start", ["zeros", "state"])
def test_prompt_equals_the_torch_recurrence(isa, T, order, start):
    q, k, v, g, beta, state = inputs(T, seed=T)
    check(q, k, v, g, beta, torch.zeros_like(state) if start == "zeros" else state, order, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("decay", [0.01, 30.0, 100.0])
def test_slow_and_fast_decays(isa, decay):
    """Decays near 1 (the block's decay factor kept apart for many positions) and tiny or zero ones (multiplied
    into the block at once)."""
    q, k, v, g, beta, state = inputs(150, decay=decay, seed=3)
    g[5, 1] = float("-inf")
    check(q, k, v, g, beta, state, "grouped", isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dims", [(1, 3, 5, 7), (2, 4, 12, 40), (4, 8, 128, 128), (1, 2, 8, 80)])
def test_head_counts_and_widths(isa, dims):
    """Widths that are not a whole column block (nor a whole vector) of the kernel set."""
    nk, nv, dk, dv = dims
    q, k, v, g, beta, state = inputs(33, nk, nv, dk, dv, seed=4)
    for order in ("grouped", "tiled"):
        check(q, k, v, g, beta, state, order, isa)


def test_rows_of_a_wider_tensor():
    """q, k, v as the model passes them: views of the conv1d's output [T, C] (positions C floats apart)."""
    from moerun.kernels import delta

    T, nk, nv, dk, dv = 20, 2, 4, 16, 32
    q, k, v, g, beta, state = inputs(T, nk, nv, dk, dv, seed=5)
    y = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=1)  # [T, C]
    qv, kv_, vv = (t.reshape(T, -1, d) for t, d in zip(y.split((nk * dk, nk * dk, nv * dv), dim=-1), (dk, dk, dv)))
    s1, s2 = state.clone(), state.clone()
    o1 = delta.delta_prompt(q, k, v, g, beta, s1, "tiled")
    o2 = delta.delta_prompt(qv, kv_, vv, g, beta, s2, "tiled")
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


@pytest.mark.parametrize("isa", ISAS)
def test_the_thread_count_does_not_change_the_result(isa):
    from moerun.kernels import delta

    q, k, v, g, beta, state = inputs(70, 2, 8, 32, 160, seed=6)
    before, outs = cpu.get_threads(), []
    try:
        for n in (1, 2, 3):
            cpu.set_threads(n)
            s = state.clone()
            outs.append((delta.delta_prompt(q, k, v, g, beta, s, "grouped", isa=isa), s))
    finally:
        cpu.set_threads(before)
    for o, s in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(s, outs[0][1])


@pytest.mark.parametrize("bad", ["k", "v", "g", "beta", "state", "heads", "dtype", "state-view", "order", "rank"])
def test_bad_arguments_are_errors(bad):
    from moerun.kernels import delta

    q, k, v, g, beta, state = inputs(10)
    if bad == "k":
        k = k[:, :, :8]
    elif bad == "v":
        v = v[:9]
    elif bad == "g":
        g = g[:, :3]
    elif bad == "beta":
        beta = beta[:9]
    elif bad == "state":
        state = state[:, :, :16]
    elif bad == "heads":
        q, k = torch.randn(10, 3, 16), torch.randn(10, 3, 16)
    elif bad == "dtype":
        v = v.double()
    elif bad == "state-view":
        state = state.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "rank":
        q = q[0]
    with pytest.raises(ValueError):
        delta.delta_prompt(q, k, v, g, beta, state, "sideways" if bad == "order" else "grouped")


def test_zero_positions():
    from moerun.kernels import delta

    q, k, v, g, beta, state = inputs(0)
    s = state.clone()
    assert delta.delta_prompt(q, k, v, g, beta, s).shape == (0, 4, 32) and torch.equal(s, state)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 9, 70])
def test_gated_output_equals_the_torch_gated_norm(isa, T):
    from moerun.kernels import delta

    q, k, v, g, beta, state = inputs(T, 2, 4, 16, 48, seed=7)
    gen = torch.Generator().manual_seed(8)
    z, norm = torch.randn(T, 4 * 48, generator=gen), 0.5 + torch.rand(48, generator=gen)
    o_ref, s_ref = deltanet.delta_steps(q, k, v, g, beta, state.clone(), "tiled")
    want = deltanet.gated_norm(o_ref, norm, z.view(T, 4, 48), 1e-6)
    s = state.clone()
    got = delta.delta_prompt(q, k, v, g, beta, s, "tiled", (z.view(T, 4, 48), norm, 1e-6), isa=isa)
    assert (got - want).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5


@pytest.mark.parametrize("K", [1, 2, 4])
def test_conv_over_chunks_equals_the_torch_conv(K):
    """The conv1d (+ SiLU) over a prompt in chunks of 1, 2, 3, 7 and 70 positions (shorter and longer than the
    window), from zeros and carrying the window: the torch form's outputs and windows; rows of a wider tensor."""
    from moerun.kernels import delta

    C, T = 300, 83
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(T, C + 5, generator=gen)[:, 2:C + 2], torch.randn(C, K, generator=gen)
    state, ref_state = torch.zeros(C, K - 1), None
    for a, b in ((0, 1), (1, 3), (3, 6), (6, 13), (13, 83)):
        want, ref_state = deltanet.conv_prompt(x[a:b], w, ref_state)
        got = delta.conv_prompt(x[a:b], w, state)
        assert (got - want).abs().max() < 1e-5 and torch.equal(state, ref_state)


def test_conv_bad_shapes_are_errors():
    from moerun.kernels import delta

    x, w = torch.randn(5, 8), torch.randn(8, 4)
    for args in ((x, w, torch.zeros(8, 2)), (x, w[:7], torch.zeros(7, 3)), (x[0], w, torch.zeros(8, 3)),
                 (x.double(), w, torch.zeros(8, 3)), (x, torch.randn(8, 17), torch.zeros(8, 16))):
        with pytest.raises(ValueError):
            delta.conv_prompt(*args)


def test_conv_and_gate_do_not_depend_on_the_thread_count():
    from moerun.kernels import delta

    q, k, v, g, beta, state = inputs(40, 2, 4, 16, 64, seed=10)
    gen = torch.Generator().manual_seed(11)
    x, w, z, norm = torch.randn(40, 700, generator=gen), torch.randn(700, 4, generator=gen), \
        torch.randn(40, 4, 64, generator=gen), torch.rand(64, generator=gen)
    before, outs = cpu.get_threads(), []
    try:
        for n in (1, 2, 3):
            cpu.set_threads(n)
            cs, s = torch.ones(700, 3), state.clone()
            outs.append((delta.conv_prompt(x, w, cs), cs, delta.delta_prompt(q, k, v, g, beta, s, gate=(z, norm, 1e-6))))
    finally:
        cpu.set_threads(before)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))
