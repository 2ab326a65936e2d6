"""A prompt's attention in the GPU's form (layers.attend_fused: 4-D SDPA, causal kernels where the positions
allow) on CPU tensors, against the CPU's blocked form and softmax attention in float64; q_start's bounds
against the searched ones; no position read from the tensors where q_start is given."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference

from moerun import device
from moerun.model import layers
from moerun.model.layers import _attend_blocks, _attend_small, _key_bounds, attend, attend_fused


def inputs(T, P, nh, nkv, D, Dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = P + T
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((T, nh, D), (S, nkv, D), (S, nkv, Dv)))
    return q, k, v, torch.arange(P, P + T), torch.arange(S)


CASES = [  # T, cached prefix, heads, KV heads, D, Dv, window
    (40, 0, 32, 4, 128, 128, 0),  # the first chunk: is_causal
    (200, 300, 32, 4, 128, 128, 0),  # after a prefix: lower-right causal
    (150, 0, 8, 2, 64, 64, 50),  # a window's band
    (60, 500, 8, 2, 64, 64, 100),  # a window shorter than the prefix: keys before it cut off
    (30, 10, 4, 4, 64, 64, 64),  # a window longer than the keys: plain causal
    (33, 7, 4, 4, 192, 128, 0),  # D != Dv (MLA's expanded form)
    (17, 3, 2, 1, 16, 16, 5),
]
IDS = ["T{}-P{}-h{}-kv{}-D{}-Dv{}-w{}".format(*c) for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_form_matches_the_reference_and_the_cpu_form(case):
    T, P, nh, _nkv, D, Dv, window = case
    q, k, v, q_pos, k_pos = inputs(*case[:6], seed=T + P)
    scale = D ** -0.5
    ref = reference(q, k, v, q_pos, k_pos, scale, window=window)
    blocks = _attend_blocks(q, k, v, q_pos, k_pos, None, window)
    for q_start in (P, None):  # the causal kernels / the mask from the positions
        got = attend_fused(q, k, v, q_pos, k_pos, None, window, q_start)
        assert got.shape == (T, nh * Dv) and got.dtype == q.dtype
        assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-4), (q_start, (got.double() - ref).abs().max())
        assert torch.allclose(got, blocks, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_fused_form_in_bfloat16(case):
    _T, P, _nh, _nkv, D, _Dv, window = case
    q, k, v, q_pos, k_pos = inputs(*case[:6], dtype=torch.bfloat16, seed=3)
    ref = reference(q, k, v, q_pos, k_pos, D ** -0.5, window=window)  # of the bfloat16 inputs
    for q_start in (P, None):
        got = attend_fused(q, k, v, q_pos, k_pos, None, window, q_start)
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), ref, atol=2e-2, rtol=2e-2), (got.double() - ref).abs().max()


def test_fused_form_with_gapped_key_positions_follows_positions():
    """Keys whose positions skip (a ring, a chunked cache): no q_start, the mask made from the positions."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((20, 4, 32), (30, 2, 32), (30, 2, 32)))
    k_pos = torch.cat((torch.arange(0, 20, 2), torch.arange(20, 40)))  # [30]: even positions, then every one
    q_pos = torch.arange(20, 40)
    for window in (0, 9):
        ref = reference(q, k, v, q_pos, k_pos, 32 ** -0.5, window=window)
        got = attend_fused(q, k, v, q_pos, k_pos, window=window)
        assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-4)


def test_a_scale_and_a_cache_dtype_other_than_the_queries():
    q, k, v, q_pos, k_pos = inputs(24, 40, 8, 2, 64, 64, seed=9)
    ref = reference(q, k.half().float(), v.half().float(), q_pos, k_pos, 0.07)
    got = attend_fused(q, k.half(), v.half(), q_pos, k_pos, 0.07, q_start=40)  # keys and values in q's dtype
    assert got.dtype == torch.float32 and torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-4)


def test_sinks_take_the_small_form():
    """Sinks join the softmax as a column SDPA has no place for: attend keeps the small form for them."""
    q, k, v, q_pos, k_pos = inputs(300, 20, 4, 2, 8, 8, seed=2)
    sinks = torch.randn(4)
    for window in (0, 50):
        ref = reference(q, k, v, q_pos, k_pos, 8 ** -0.5, sinks, window)
        for q_start in (20, None):
            got = attend(q, k, v, q_pos, k_pos, sinks=sinks, window=window, q_start=q_start)
            assert torch.allclose(got.double(), ref, atol=1e-5)


@pytest.mark.parametrize("T,P,window", [(300, 20, 0), (300, 20, 50), (129, 0, 0), (257, 1000, 7), (40, 5, 3)])
def test_q_start_bounds_are_the_searched_bounds(T, P, window):
    q_pos, k_pos = torch.arange(P, P + T), torch.arange(P + T)
    for a in range(0, T, layers.QUERY_BLOCK):
        b = min(a + layers.QUERY_BLOCK, T)
        assert _key_bounds(q_pos, k_pos, a, b, window, P) == _key_bounds(q_pos, k_pos, a, b, window, None)
    if window:  # a ring: the keys start at the first query's window
        lo = max(0, P - window + 1)
        assert _key_bounds(q_pos, k_pos[lo:], 0, T, window, P) == _key_bounds(q_pos, k_pos[lo:], 0, T, window, None)


@pytest.mark.parametrize("T,P,window,sinks", [(1, 30, 0, False), (1, 30, 8, True), (1, 5, 8, False),
                                               (9, 30, 0, True), (200, 60, 0, False), (300, 20, 50, True)])
def test_q_start_changes_no_result(T, P, window, sinks):
    """The CPU's forms with q_start (bounds by arithmetic, the mask skipped by shapes) give the same bits."""
    q, k, v, q_pos, k_pos = inputs(T, P, 8, 2, 32, 32, seed=T * 7 + P)
    s = torch.randn(8) if sinks else None
    want = attend(q, k, v, q_pos, k_pos, sinks=s, window=window)
    assert torch.equal(attend(q, k, v, q_pos, k_pos, sinks=s, window=window, q_start=P), want)


class Unreadable(torch.Tensor):
    """Positions that refuse to be read on the host (as a GPU's would cost a synchronisation each)."""

    def __bool__(self):
        raise AssertionError("positions read on the host")

    __int__ = __index__ = __float__ = __bool__

    def item(self):
        raise AssertionError("positions read on the host")

    def tolist(self):
        raise AssertionError("positions read on the host")


@pytest.mark.parametrize("T,P,window,sinks", [(1, 30, 0, False), (1, 30, 8, True), (300, 20, 50, True),
                                               (200, 60, 0, False), (150, 0, 50, False)])
def test_no_position_is_read_where_q_start_is_given(T, P, window, sinks):
    q, k, v, q_pos, k_pos = inputs(T, P, 8, 2, 32, 32, seed=1)
    s = torch.randn(8) if sinks else None
    want = attend(q, k, v, q_pos, k_pos, sinks=s, window=window)
    qp, kp = q_pos.as_subclass(Unreadable), k_pos.as_subclass(Unreadable)
    got = attend(q, k, v, qp, kp, sinks=s, window=window, q_start=P)
    assert torch.equal(got.as_subclass(torch.Tensor), want)
    if T > layers.SMALL_T and not sinks:
        fused = attend_fused(q, k, v, qp, kp, None, window, P).as_subclass(torch.Tensor)
        assert torch.allclose(fused, want, atol=2e-5, rtol=1e-4)
    if T == 1 and not window:  # one query at the keys' end: nothing to mask, no mask made
        got = _attend_small(q, k, v, qp, kp, q_start=P).as_subclass(torch.Tensor)
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_on_a_gpu_the_fused_kernels_take_the_form(case, dtype):
    """On CUDA attend takes the fused form; the flash / memory-efficient kernels accept it where they can."""
    if not device.cuda_available():
        pytest.skip("no CUDA device")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    T, P, _nh, _nkv, D, Dv, window = case
    q, k, v, q_pos, k_pos = inputs(*case[:6], dtype=dtype, seed=4)
    ref = reference(q, k, v, q_pos, k_pos, D ** -0.5, window=window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    dev = torch.device("cuda:0")
    q, k, v, q_pos, k_pos = (t.to(dev) for t in (q, k, v, q_pos, k_pos))
    got = attend(q, k, v, q_pos, k_pos, window=window, q_start=P)
    assert torch.allclose(got.double().cpu(), ref, atol=tol, rtol=tol)
    kernels = [SDPBackend.EFFICIENT_ATTENTION] + ([SDPBackend.FLASH_ATTENTION] if dtype != torch.float32 and D == Dv
                                                  and D <= 256 and not (window and window < T + P) else [])
    for kernel in kernels:
        with sdpa_kernel([kernel]):
            got = attend_fused(q, k, v, q_pos, k_pos, None, window, P)
        assert torch.allclose(got.double().cpu(), ref, atol=tol, rtol=tol), kernel


@pytest.mark.parametrize("T,P", [(1, 40), (40, 0), (200, 30)])
def test_mla_forms_take_q_start(T, P):
    """Both MLA forms pass q_start to attend: the same bits as without it."""
    from moerun.model.layers import mla_absorbed, mla_expanded

    g = torch.Generator().manual_seed(T + P)
    nh, rank, nope, rope, dv = 4, 32, 16, 8, 16
    q_nope, q_pe = torch.randn(T, nh, nope, generator=g), torch.randn(T, nh, rope, generator=g)
    latent = torch.randn(P + T, rank + rope, generator=g)
    wk_b, wv_b = torch.randn(nh, rank, nope, generator=g), torch.randn(nh, dv, rank, generator=g)
    q_pos, k_pos = torch.arange(P, P + T), torch.arange(P + T)
    for form in (mla_absorbed, mla_expanded):
        want = form(q_nope, q_pe, latent, wk_b, wv_b, q_pos, k_pos, 0.2)
        assert torch.equal(form(q_nope, q_pe, latent, wk_b, wv_b, q_pos, k_pos, 0.2, q_start=P), want)
