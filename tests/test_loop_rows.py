"""The layer loop's C pieces (moerun.kernels.rows) against their torch forms (moerun.model.layers, moerun.model.moe):
RMSNorm, RoPE, the output gate, attention with sinks and windows, MLA's absorbed attention and every router agree
to float noise, and bad shapes are refused. (tests/test_fused_families.py checks that the loop built from these
equals the fused layers bit for bit.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moerun.model import layers
from moerun.model.moe import route
from moerun.model.ops import ReferenceOps

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels not built")
rows = pytest.importorskip("moerun.kernels.rows")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_equals_the_torch_form():
    g = gen(0)
    x, w = torch.randn(5, 3, 96, generator=g) * 3, torch.randn(96, generator=g)
    got = rows.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, layers.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        rows.rms_norm(x, w[:64], 1e-6)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("R", [64, 32])
def test_rope_equals_the_torch_form_partial_too(style, R):
    g = gen(R)
    x = torch.randn(3, 4, 64, generator=g)
    cos, sin = layers.rope_tables(torch.tensor([0, 7, 300]), R, 10000.0)
    got = rows.rope(x, cos, sin, style == "neox")
    torch.testing.assert_close(got, layers.apply_rope(x, cos, sin, style), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., R:], x[..., R:])  # the rest passes through
    with pytest.raises(ValueError, match="rope"):
        rows.rope(x, cos[:2], sin[:2], True)


def test_gate_equals_x_times_sigmoid():
    g = gen(1)
    x, gate = torch.randn(4, 256, generator=g), torch.randn(4, 256, generator=g) * 4
    torch.testing.assert_close(rows.gate_mul(x, gate), x * torch.sigmoid(gate), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="gate_mul"):
        rows.gate_mul(x, gate[:2])


@pytest.mark.parametrize("T, window, sinks", [(1, 0, False), (4, 0, False), (3, 8, True), (1, 5, False)])
def test_attention_equals_the_torch_form(T, window, sinks):
    """One sequence's T queries at the end of S keys (GQA 8 / 2 heads), causal within the step; a window's ring
    starts later than 0, as the cache's ring hands it over."""
    g = gen(T + window)
    end = 20
    k_start = max(0, end - T - window + 1) if window else 0
    S = end - k_start
    q = torch.randn(T, 8, 32, generator=g)
    k, v = torch.randn(S, 2, 32, generator=g), torch.randn(S, 2, 32, generator=g)
    sk = torch.randn(8, generator=g) if sinks else None
    q_start = end - T
    got = rows.attend(q, k, v, q_start, k_start, None, sk, window)
    ref = layers.attend(q, k, v, torch.arange(q_start, end), torch.arange(k_start, end), sinks=sk, window=window,
                        q_start=q_start)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="attend"):
        rows.attend(q, k, v, q_start + 1, k_start, None, sk, window)  # positions that do not end together


@pytest.mark.parametrize("nh, nkv, D", [(32, 4, 128), (12, 1, 64), (4, 4, 48), (24, 2, 32), (16, 2, 256), (6, 2, 40),
                                         (16, 1, 64), (40, 2, 32), (26, 2, 48)])
@pytest.mark.parametrize("isa", cpu.features()["isas"] if cpu.available() else [])
def test_decode_attention_of_every_group_shape(nh, nkv, D, isa):
    """One query over 1-300 keys with sinks: groups of 1 to 20 heads a key head (the AVX-512 group kernel takes 8 at a
    time, the rest padded: 12, 13 and 20 heads), head sizes in 16s and not (40: the per-head loops), every kernel set
    against the torch form; more keys than the group kernel prefetches ahead."""
    g = gen(nh * D)
    for S in (1, 9, 300):
        q = torch.randn(1, nh, D, generator=g)
        k, v = torch.randn(S, nkv, D, generator=g) * 2, torch.randn(S, nkv, D, generator=g)
        sk = torch.randn(nh, generator=g)
        for sinks in (None, sk):
            got = rows.attend(q, k, v, S - 1, 0, None, sinks, 0, isa=isa)
            ref = layers.attend(q, k, v, torch.arange(S - 1, S), torch.arange(S), sinks=sinks, window=0,
                                q_start=S - 1)
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("isa", cpu.features()["isas"] if cpu.available() else [])
def test_decode_attention_of_a_head_does_not_depend_on_its_pass(isa):
    """Heads 8-11 of a group of 12 equal the same 4 heads alone and heads 0-7 a group of 8, bit for bit: a head's sums
    do not depend on the heads it shares a pass with (a kernel that takes 12 at once must keep this)."""
    g = gen(12)
    for S in (5, 200):
        q = torch.randn(1, 12, 64, generator=g)
        k, v = torch.randn(S, 1, 64, generator=g), torch.randn(S, 1, 64, generator=g)
        sk = torch.randn(12, generator=g)
        whole = rows.attend(q, k, v, S - 1, 0, None, sk, 0, isa=isa).view(12, 64)
        first = rows.attend(q[:, :8].contiguous(), k, v, S - 1, 0, None, sk[:8].contiguous(), 0, isa=isa).view(8, 64)
        last = rows.attend(q[:, 8:].contiguous(), k, v, S - 1, 0, None, sk[8:].contiguous(), 0, isa=isa).view(4, 64)
        assert torch.equal(whole[:8], first) and torch.equal(whole[8:], last)


@pytest.mark.parametrize("T, nh, nope, R, rank, dv, S", [(2, 4, 16, 8, 32, 16, 11), (3, 12, 16, 16, 64, 16, 300),
                                                         (2, 16, 16, 64, 512, 16, 40)])
@pytest.mark.parametrize("isa", cpu.features()["isas"] if cpu.available() else [])
def test_mla_equals_the_absorbed_torch_form(T, nh, nope, R, rank, dv, S, isa):
    """Latents of 40 values (the per-head loops everywhere) and of 80 and 576 (eight heads at a time through the group
    kernel where AVX-512 is: 12 heads as 8 + 4, rows of a step side by side, more keys than it prefetches ahead)."""
    g = gen(5 + nh)
    qn, qp = torch.randn(T, nh, nope, generator=g), torch.randn(T, nh, R, generator=g)
    lat = torch.randn(S, rank + R, generator=g)
    wk, wv = torch.randn(nh, rank, nope, generator=g) / 4, torch.randn(nh, dv, rank, generator=g) / 6
    got = rows.mla(qn, qp, lat, wk, wv, S - T, 0.2, isa=isa)
    ref = layers.mla_absorbed(qn, qp, lat, wk, wv, torch.arange(S - T, S), torch.arange(S), 0.2, q_start=S - T)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6 * max(1, rank // 32))  # float32 sums of rank terms
    with pytest.raises(ValueError, match="mla"):
        rows.mla(qn, qp, lat[:, :rank], wk, wv, S - T, 0.2, isa=isa)


ROUTERS = {
    "softmax": {"router": "softmax", "norm_topk": True},
    "softmax groups": {"router": "softmax", "norm_topk": False, "n_groups": 4, "topk_groups": 2},
    "topk_softmax": {"router": "topk_softmax", "norm_topk": False},
    "sigmoid": {"router": "sigmoid", "norm_topk": True, "n_groups": 4, "topk_groups": 2, "group_score": "top2", "routed_scale": 2.5},
}


@pytest.mark.parametrize("kind", list(ROUTERS))
def test_router_equals_the_torch_form(kind):
    g = gen(len(kind))
    spec = SimpleNamespace(**{"n_experts_used": 4, "n_groups": 1, "topk_groups": 1, "group_score": "max",
                              "routed_scale": 1.0, **ROUTERS[kind]})
    logits = torch.randn(6, 32, generator=g) * 2
    score_b = torch.randn(32, generator=g) * 0.1 if kind == "sigmoid" else None
    lw = SimpleNamespace(router=None, router_b=None, score_b=score_b)
    w_ref, ids_ref = route(ReferenceOps(), torch.zeros(6, 8), lw, spec, logits=logits)
    w, ids = rows.route(logits, spec, score_b)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_a_prompts_norms_rope_and_gate_take_the_rows_arithmetic():
    """A prompt-sized step (past the 16 rows the fused layers take) normalises, rotates and gates each row as a
    one-row step does, bit for bit, on the pool's threads or one: one arithmetic for a token's rows whatever the
    step's size, and none of torch's (its float32 mean of squares rounds otherwise than the rows' double one)."""
    from moerun.model.ops import KernelOps

    threads = cpu.get_threads()
    cpu.set_threads(2)
    ops, g = KernelOps(), gen(7)
    T, H = 300, 256  # 76,800 values a tensor: rows on the pool (a one-row step's on the caller)
    x, w = torch.randn(T, H, generator=g) * 3, torch.randn(H, generator=g)
    q, wq = torch.randn(T, 4, 64, generator=g), torch.randn(64, generator=g)
    cos, sin = layers.rope_tables(torch.arange(100, 100 + T), 48, 10000.0)  # partial: 48 of 64 dimensions
    gate = torch.randn(T, H, generator=g) * 4
    whole = [ops.rms_norm(x, w, 1e-6), ops.rms_norm(q, wq, 1e-6), ops.rope(q, cos, sin, "neox"),
             ops.rope(q, cos, sin, "interleaved"), ops.gate(x, gate)]
    for t in (0, 17, 161, T - 1):
        one = [ops.rms_norm(x[t:t + 1], w, 1e-6), ops.rms_norm(q[t:t + 1], wq, 1e-6),
               ops.rope(q[t:t + 1], cos[t:t + 1], sin[t:t + 1], "neox"),
               ops.rope(q[t:t + 1], cos[t:t + 1], sin[t:t + 1], "interleaved"), ops.gate(x[t:t + 1], gate[t:t + 1])]
        for a, b in zip(whole, one):
            assert torch.equal(a[t:t + 1], b)
    assert not torch.equal(whole[0], layers.rms_norm(x, w, 1e-6))  # not torch's rounding
    torch.testing.assert_close(whole[0], layers.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(whole[2], layers.apply_rope(q, cos, sin, "neox"), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole[3], layers.apply_rope(q, cos, sin, "interleaved"), rtol=1e-6, atol=1e-6)
    cpu.set_threads(1)
    assert torch.equal(ops.rms_norm(q, wq, 1e-6), whole[1]) and torch.equal(ops.rope(q, cos, sin, "neox"), whole[2])
    cpu.set_threads(threads)
