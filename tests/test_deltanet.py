"""moerun.model.deltanet against transformers' reference functions (Qwen3-Next's torch fallbacks): the chunked
delta rule, the step, the conv1d window, for grouped and tiled value heads."""

from __future__ import annotations

import pytest
import torch

from moerun.model import deltanet

ref = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def inputs(T: int, nk: int = 2, nv: int = 4, dk: int = 8, dv: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, nk, dk, generator=g), torch.randn(T, nk, dk, generator=g)
    v = torch.randn(T, nv, dv, generator=g)
    decay = -2 * torch.rand(T, nv, generator=g)
    beta = torch.rand(T, nv, generator=g)
    state = 0.1 * torch.randn(nv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


def reference(q, k, v, decay, beta, state):
    out, s = ref.torch_chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                              initial_state=None if state is None else state[None],
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], s[0]


@pytest.mark.parametrize("T", [1, 5, 64, 150])
@pytest.mark.parametrize("start", ["zeros", "state"])
def test_chunked_equals_transformers(T, start):
    q, k, v, decay, beta, state = inputs(T)
    state = None if start == "zeros" else state
    o, s = deltanet.delta_chunked(q, k, v, decay, beta, state)
    o_ref, s_ref = reference(q, k, v, decay, beta, state)
    assert (o - o_ref).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5


def test_steps_of_several_sequences_equal_transformers():
    """Two sequences stepped together, token by token: each one's reference."""
    seqs = [inputs(12, seed=s) for s in (1, 2)]
    states = torch.stack([x[5] for x in seqs])
    outs = []
    for t in range(12):
        o, states = deltanet.delta_step(*(torch.stack([x[i][t] for x in seqs]) for i in range(5)), states)
        outs.append(o)
    for b, x in enumerate(seqs):
        o_ref, s_ref = reference(*x)
        assert (torch.stack(outs)[:, b] - o_ref).abs().max() < 1e-5 and (states[b] - s_ref).abs().max() < 1e-5


def test_tiled_value_heads():
    """ssm_v_order "tiled": value head j reads key head j % nk (llama.cpp's qwen35moe order), checked against the
    reference given q and k repeated onto the value heads in that order."""
    q, k, v, decay, beta, state = inputs(20)
    o, s = deltanet.delta_chunked(q, k, v, decay, beta, state, order="tiled")
    o_ref, s_ref = reference(q.repeat(1, 2, 1), k.repeat(1, 2, 1), v, decay, beta, state)
    assert (o - o_ref).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5
    o1, s1 = deltanet.delta_step(q[:1], k[:1], v[:1], decay[:1], beta[:1], state[None], order="tiled")
    o1_ref, s1_ref = reference(q[:1].repeat(1, 2, 1), k[:1].repeat(1, 2, 1), v[:1], decay[:1], beta[:1], state)
    assert (o1[0] - o1_ref[0]).abs().max() < 1e-5 and (s1[0] - s1_ref).abs().max() < 1e-5


def test_conv_window_across_chunks():
    """The causal conv1d (+ SiLU) over a prompt in chunks of 1, 2 and 5 (shorter and longer than the window),
    and steps, equal transformers' over the whole prompt."""
    C, K, T = 6, 4, 13
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(T, C, generator=g), torch.randn(C, K, generator=g)
    want = ref.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()  # [T, C]
    state, got = None, []
    for a, b in ((0, 1), (1, 3), (3, 8), (8, 10)):
        y, state = deltanet.conv_prompt(x[a:b], w, state)
        got.append(y)
    for t in range(10, T):
        y, state = deltanet.conv_step(x[t:t + 1], w, state[None])
        state = state[0]
        got.append(y)
    assert (torch.cat(got) - want).abs().max() < 1e-6


@pytest.mark.parametrize("tiled", [False, True])
def test_c_step_equals_the_torch_step(tiled):
    """moerun.kernels.delta (one C call: conv window, delta rule, gated norm, slots updated in place) against
    the torch forms it replaces, for three sequences in scattered slots, one of them starting afresh."""
    from moerun.kernels import cpu, delta

    if not cpu.available():
        pytest.skip("the C kernels are not built")
    nk, nv, dk, dv, K, B = 2, 4, 8, 16, 4, 3
    C = 2 * nk * dk + nv * dv
    g = torch.Generator().manual_seed(5)
    conv, ssm = torch.randn(6, C, K - 1, generator=g), 0.1 * torch.randn(6, nv, dk, dv, generator=g)
    qkv, z = torch.randn(B, C, generator=g), torch.randn(B, nv * dv, generator=g)
    b, a = torch.randn(B, nv, generator=g), torch.randn(B, nv, generator=g)
    w, A, dt = torch.randn(C, K, generator=g), -4 * torch.rand(nv, generator=g), torch.randn(nv, generator=g)
    norm = 0.5 + torch.rand(dv, generator=g)
    slots, fresh = torch.tensor([5, 0, 2]), torch.tensor([False, True, False])
    c0 = conv[slots].masked_fill(fresh[:, None, None], 0.0)
    s0 = ssm[slots].masked_fill(fresh[:, None, None, None], 0.0)
    y, c1 = deltanet.conv_step(qkv, w, c0)
    q, k, v = y.split((nk * dk, nk * dk, nv * dv), dim=-1)
    o, s1 = deltanet.delta_step(q.view(B, nk, dk), k.view(B, nk, dk), v.view(B, nv, dv),
                                A * torch.nn.functional.softplus(a + dt), torch.sigmoid(b), s0,
                                "tiled" if tiled else "grouped")
    want = deltanet.gated_norm(o, norm, z.view(B, nv, dv), 1e-6).reshape(B, -1)
    untouched = conv[1].clone()
    got = delta.delta_step(qkv, z, b, a, conv, ssm, slots, fresh, w, A, dt, norm, 1e-6, nk, tiled)
    assert (got - want).abs().max() < 1e-5
    assert (conv[slots] - c1).abs().max() < 1e-6 and (ssm[slots] - s1).abs().max() < 1e-5
    assert torch.equal(conv[1], untouched)
    with pytest.raises(ValueError, match="out of the pool's range"):
        delta.delta_step(qkv, z, b, a, conv, ssm, torch.tensor([5, 0, 6]), fresh, w, A, dt, norm, 1e-6, nk, tiled)
