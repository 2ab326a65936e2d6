"""moerun.kernels.triton_decode / triton_attn (the decode step's non-GEMM Triton kernels) against moerun's own
torch references (layers.rms_norm / apply_rope / attend, moe.route, QTensor.dequantize) and independent
formulas (float64 attention and RoPE, gguf.quants.dequantize, a float64 router).

Without CUDA the kernels run in triton's CPU interpreter: TRITON_INTERPRET=1 is set for this module only,
and the kernel modules are (re)built under it; they go back to the environment's mode afterwards. Every
launch goes through moerun.device.launch: the real one, or a recorder (`launches`: each wrapper makes exactly
one launch, grids and constexprs from shapes only); on the stand-in a whole step of them is captured as a
graph with no sync and replayed on new inputs. The sm_90 / sm_86 compilation of every ptx_cases() entry runs
in a subprocess with TRITON_INTERPRET unset (triton's library must be built compiled).
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import qblocks
import torch
from triton_env import interpreter

pytest.importorskip("triton")

from gguf.quants import dequantize as gguf_dequantize

from moerun import device, standin
from moerun.arch.spec import Yarn
from moerun.kernels import triton_q as tq
from moerun.model.layers import apply_rope, attend, rms_norm, rope_frequencies, rope_tables
from moerun.model.moe import route as ref_route
from moerun.model.ops import ReferenceOps
from moerun.quant.qtypes import QTensor, QType
from moerun.quant.quantize import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = types.SimpleNamespace(ta=None, td=None)  # the kernel modules, built under this module's mode


def _build():
    from moerun.kernels import triton_attn, triton_decode

    mode = tq.interpreting()
    ta = triton_attn if triton_attn.INTERPRETED == mode else importlib.reload(triton_attn)
    td = triton_decode if triton_decode.INTERPRETED == mode and triton_decode.qk_rope_kv_write is \
        ta.qk_rope_kv_write else importlib.reload(triton_decode)
    return ta, td


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    try:
        with interpreter():
            K.ta, K.td = _build()
            yield
    finally:
        _build()


@pytest.fixture
def launches(monkeypatch):
    """Every device.launch recorded as (kernel, grid, constexpr kwargs), then run."""
    log = []

    def launch(kernel, grid, *args, **kwargs):
        assert all(a.device.type == DEVICE for a in args if isinstance(a, torch.Tensor))
        log.append((kernel, tuple(grid), dict(kwargs)))
        return kernel[grid](*args, **kwargs)

    monkeypatch.setattr(device, "launch", launch)
    return log


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal; for bfloat16 under the interpreter within one unit in the last place (triton's interpreter
    truncates float32 -> bfloat16 where a GPU rounds to nearest even)."""
    if a.dtype == torch.bfloat16 and DEVICE == "cpu":
        return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=0)
    return torch.equal(a, b)


# ------------------------------------------------------------------------------------------ rope + kv write


def rope64(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, rot: int, style: str, factor: float):
    """Independent RoPE: pairs (neox: i, i + rot/2; interleaved: 2i, 2i + 1) turned by the angle pos * inv[i]
    as complex numbers in float64 (the angle is float32, as moerun defines it). x [B, heads, D]."""
    x = x.double().clone()
    i = torch.arange(rot // 2)
    a, b = (i, i + rot // 2) if style == "neox" else (2 * i, 2 * i + 1)
    ang = (pos.float()[:, None] * inv.float()[None, :]).double()  # [B, rot/2]
    z = torch.complex(x[..., a], x[..., b]) * torch.polar(torch.full_like(ang, factor), ang)[:, None, :]
    x[..., a], x[..., b] = z.real, z.imag
    return x


def norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style,rot,norm,gate", [("neox", 32, True, False), ("interleaved", 32, False, False),
                                                 ("neox", 16, False, True), ("interleaved", 16, True, True)])
@pytest.mark.parametrize("b", [1, 3])
def test_qk_rope_kv_write(cache_dtype, style, rot, norm, gate, b, launches):
    nh, nkv, d, s, eps = 4, 2, 32, 40, 1e-6
    g = gen(b * 100 + rot)
    qw = nh * d * (2 if gate else 1)
    qkv = dev(torch.randn(b, qw + 2 * nkv * d, generator=g))
    pos = torch.tensor([7, 0, 3001][:b], dtype=torch.int32)
    slots = torch.tensor([33, 5, 17][:b], dtype=torch.int32)
    yarn = Yarn(factor=4.0, original_context=256, attention_factor=1.1) if rot == 16 else None
    inv = rope_frequencies(rot, 1e4, yarn)
    factor = yarn.attention_factor if yarn else 1.0
    qn, kn = (torch.randn(d, generator=g) for _ in range(2)) if norm else (None, None)
    kc = dev(torch.randn(s, nkv, d, generator=g).to(cache_dtype))
    vc = dev(torch.randn(s, nkv, d, generator=g).to(cache_dtype))
    k0, v0 = kc.clone(), vc.clone()
    q_out = dev(torch.empty(b, nh, d))
    g_out = dev(torch.empty(b, nh * d)) if gate else None
    K.td.qk_rope_kv_write(qkv, dev(pos), dev(slots), kc, vc, q_out, n_heads=nh, n_kv_heads=nkv, head_dim=d,
                          inv_freq=dev(inv), rotary_dim=rot, rope_style=style, attn_factor=factor,
                          q_norm=None if qn is None else dev(qn), k_norm=None if kn is None else dev(kn),
                          eps=eps, gate_out=g_out)
    assert len(launches) == 1 and launches[0][1] == (b, nh + nkv)
    qkv = qkv.cpu()
    q, k, v = qkv[:, :qw], qkv[:, qw:qw + nkv * d].view(b, nkv, d), qkv[:, qw + nkv * d:].view(b, nkv, d)
    if gate:
        q, gt = (t.reshape(b, -1) for t in q.view(b, nh, 2 * d).chunk(2, dim=-1))
        assert torch.equal(g_out.cpu(), gt)
    q = q.reshape(b, nh, d)
    # moerun's reference
    qr, kr = (rms_norm(q, qn, eps), rms_norm(k, kn, eps)) if norm else (q, k)
    cos, sin = rope_tables(pos, rot, 1e4, yarn)
    qr, kr = apply_rope(qr, cos, sin, style), apply_rope(kr, cos, sin, style)
    assert (q_out.cpu() - qr).abs().max() <= 4e-6 * qr.abs().max()
    # independent float64
    q64, k64 = (norm64(q, qn, eps), norm64(k, kn, eps)) if norm else (q.double(), k.double())
    q64, k64 = rope64(q64, pos, inv, rot, style, factor), rope64(k64, pos, inv, rot, style, factor)
    assert (q_out.cpu().double() - q64).abs().max() <= 4e-6 * q64.abs().max()
    # k / v land at the slots, converted; nothing else changes
    want_k, want_v = k0.cpu().clone(), v0.cpu().clone()
    want_k[slots.long()] = kr.to(cache_dtype)
    want_v[slots.long()] = v.to(cache_dtype)
    tol = 4e-6 if cache_dtype == torch.float32 else 2 ** -7
    assert torch.allclose(kc.cpu().float(), want_k.float(), rtol=tol, atol=4e-6)
    assert same(vc.cpu(), want_v)
    others = torch.ones(s, dtype=torch.bool)
    others[slots.long()] = False
    assert torch.equal(kc.cpu()[others], k0.cpu()[others]) and torch.equal(vc.cpu()[others], v0.cpu()[others])


def test_qk_rope_negative_slot_writes_nothing():
    nh, nkv, d = 2, 1, 16
    qkv = dev(torch.randn(2, (nh + 2 * nkv) * d, generator=gen(3)))
    kc, vc = dev(torch.zeros(8, nkv, d)), dev(torch.zeros(8, nkv, d))
    q_out = dev(torch.empty(2, nh, d))
    pos, slots = dev(torch.tensor([4, 9], dtype=torch.int32)), dev(torch.tensor([-1, 6], dtype=torch.int32))
    K.td.qk_rope_kv_write(qkv, pos, slots, kc, vc, q_out, n_heads=nh, n_kv_heads=nkv, head_dim=d,
                          inv_freq=dev(rope_frequencies(d, 1e4)))
    assert kc.cpu()[torch.arange(8) != 6].abs().sum() == 0 and vc.cpu()[torch.arange(8) != 6].abs().sum() == 0
    assert torch.equal(vc.cpu()[6, 0], qkv.cpu()[1, (nh + nkv) * d:])


# ------------------------------------------------------------------------------------------ attention


def attention64(q, k, v, scale, sinks=None):
    """q [nh, D], k [S, nkv, D], v [S, nkv, Dv] -> [nh * Dv] in float64 (a sink: a logit with no value)."""
    nh, nkv = q.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(nh // nkv, dim=1)  # [S, nh, D]
    vv = v.double().repeat_interleave(nh // nkv, dim=1)
    s = torch.einsum("hd,shd->hs", q.double(), kk) * scale  # [nh, S]
    if sinks is not None:
        s = torch.cat((s, sinks.double()[:, None]), dim=1)
    p = torch.softmax(s, dim=1)[:, :kk.shape[0]]
    return torch.einsum("hs,shd->hd", p, vv).reshape(-1)


def paged_cache(b, lengths, nkv, d, bs, dtype, g, ring=0):
    """A cache [S, nkv, D] holding each row's positions at random blocks (ring > 0: the rows' rings, written
    in position order so later positions overwrite earlier ones), the table, and each row's true k, v."""
    blocks = (max(lengths) + bs - 1) // bs if not ring else ring
    n_blocks = b * blocks + 3
    perm = torch.randperm(n_blocks, generator=g)[:b * blocks].view(b, blocks).to(torch.int32)
    kc = torch.randn(n_blocks * bs, nkv, d, generator=g).to(dtype)
    vc = torch.randn(n_blocks * bs, nkv, d, generator=g).to(dtype)
    truth = []
    for r, n in enumerate(lengths):
        kt = torch.randn(n, nkv, d, generator=g).to(dtype)
        vt = torch.randn(n, nkv, d, generator=g).to(dtype)
        p = torch.arange(n)
        j = (p // bs) % ring if ring else p // bs
        slots = perm[r].long()[j] * bs + p % bs
        for i in range(n):
            kc[slots[i]], vc[slots[i]] = kt[i], vt[i]
        truth.append((kt, vt))
    return kc, vc, perm, truth


CASES = [  # b, nh, nkv, sinks, window, ring, splits, gate
    (1, 4, 2, False, 0, 0, None, False),
    (3, 4, 2, False, 0, 0, 3, False),
    (3, 4, 1, True, 0, 0, None, False),
    (3, 2, 2, True, 0, 0, 4, True),
    (3, 4, 2, True, 12, 0, None, False),
    (3, 4, 2, True, 12, 5, None, False),
    (1, 4, 2, False, 12, 5, 2, True),
]


@pytest.mark.parametrize("cache_dtype,precise", [
    (torch.float32, True), (torch.float16, True), (torch.float16, False), (torch.bfloat16, True),
    pytest.param(torch.bfloat16, False, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="triton's interpreter multiplies bfloat16 dot operands' integer bits"))],
    ids=str)
@pytest.mark.parametrize("b,nh,nkv,sinks,window,ring,splits,gate", CASES)
def test_decode_attention(cache_dtype, precise, b, nh, nkv, sinks, window, ring, splits, gate, launches):
    """precise: every product in float32 (float32 rounding against both references); else q and the
    probabilities rounded to the 16-bit cache type for the tensor cores (that rounding's bound)."""
    d, bs = 32, 4
    g = gen(b * 7 + nh + window + ring + (splits or 0))
    lengths = [70, 1, 33][:b]
    kc, vc, table, truth = paged_cache(b, lengths, nkv, d, bs, cache_dtype, g, ring)
    q = torch.randn(b, nh, d, generator=g)
    sk = torch.randn(nh, generator=g) * 2 if sinks else None
    gt = torch.randn(b, nh * d, generator=g) if gate else None
    scale = d ** -0.5
    out = dev(torch.full((b, nh * d), float("nan")))
    ws = K.ta.attention_workspace(b, nh, nkv, d, splits, DEVICE) if splits else None
    K.td.decode_attention(dev(q), dev(kc), dev(vc), dev(table), dev(torch.tensor(lengths, dtype=torch.int32)),
                          out, scale=scale, block_size=bs, ring=ring, window=window,
                          sinks=None if sk is None else dev(sk),
                          gate=None if gt is None else dev(gt), max_positions=80, splits=splits, workspace=ws,
                          precise=precise)
    assert len(launches) == 1 and launches[0][2]["MMA"] == (not precise)
    if splits:
        assert launches[0][1] == (b, nkv, splits) and not ws[1].cpu().any()  # counters back at zero
    out = out.cpu()
    for r, n in enumerate(lengths):
        kt, vt = truth[r]
        lo = max(0, n - window) if window else 0
        ref64 = attention64(q[r], kt[lo:].float(), vt[lo:].float(), scale, sk)
        p = torch.arange(n)
        ref = attend(q[r:r + 1], kt.float(), vt.float(), torch.tensor([n - 1]), p, scale=scale, sinks=sk,
                     window=window)[0]
        if gt is not None:
            ref64, ref = ref64 * torch.sigmoid(gt[r].double()), ref * torch.sigmoid(gt[r])
        tol = 2e-6 if precise else 8 * 2.0 ** -(11 if cache_dtype == torch.float16 else 8)
        assert (out[r].double() - ref64).abs().max() <= tol * max(1.0, ref64.abs().max().item())
        assert (out[r] - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())


def test_attention_split_deterministic_and_static(launches):
    """Splits agree with one pass; repeated calls give the same bits; the launch (grid, constexprs) depends on
    shapes only, not on the lengths; a row of length 0 gives zeros."""
    b, nh, nkv, d, bs = 3, 4, 2, 32, 4
    g = gen(11)
    kc, vc, table, _ = paged_cache(b, [200, 5, 131], nkv, d, bs, torch.float32, g)
    q = dev(torch.randn(b, nh, d, generator=g))
    kc, vc, table = dev(kc), dev(vc), dev(table)
    ws = K.ta.attention_workspace(b, nh, nkv, d, 4, DEVICE)
    outs = []
    for lengths, splits in (([200, 5, 131], 4), ([200, 5, 131], 4), ([200, 5, 131], 1), ([17, 0, 190], 4)):
        out = dev(torch.empty(b, nh * d))
        K.td.decode_attention(q, kc, vc, table, dev(torch.tensor(lengths, dtype=torch.int32)), out, scale=0.2,
                              block_size=bs, splits=splits, workspace=ws)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] - outs[2]).abs().max() <= 1e-6
    assert torch.equal(outs[3][1], torch.zeros(nh * d))
    assert launches[0][:2] == launches[3][:2] and launches[0][2] == launches[3][2]
    assert K.ta.attention_splits(1, 4, 32768) == (64, 512)  # long context, one row: many splits
    assert K.ta.attention_splits(64, 4, 32768)[0] == 1  # a large batch fills the GPU without them
    assert K.ta.attention_splits(1, 8, 131072, window=128) == (1, 128)


# ------------------------------------------------------------------------------------------ routing


def route64(logits, k, mode, norm, scale, score_b, logit_b, n_groups, topk_groups, group_score):
    """Independent router in float64 / numpy: (ids [B, k], weights [B, k])."""
    x = logits.double().numpy() + (0 if logit_b is None else logit_b.double().numpy())
    b, _e = x.shape
    ids, ws = np.zeros((b, k), dtype=np.int64), np.zeros((b, k))
    for r in range(b):
        if mode == "topk_softmax":
            i = np.argsort(-x[r], kind="stable")[:k]
            w = np.exp(x[r, i] - x[r, i].max())
            ids[r], ws[r] = i, w / w.sum() * scale
            continue
        ex = np.exp(x[r] - x[r].max())
        s = ex / ex.sum() if mode == "softmax" else 1 / (1 + np.exp(-x[r]))
        c = s + (0 if score_b is None else score_b.double().numpy())
        if n_groups > 1:
            grp = c.reshape(n_groups, -1)
            gs = grp.max(1) if group_score == "max" else np.sort(grp, 1)[:, -2:].sum(1)
            keep = np.argsort(-gs, kind="stable")[:topk_groups]
            mask = np.full(n_groups, -np.inf)
            mask[keep] = 0
            c = (grp + mask[:, None]).reshape(-1)
        i = np.argsort(-c, kind="stable")[:k]
        w = s[i]
        if norm:
            w = w / (w.sum() + (1e-20 if mode == "sigmoid" else 0))
        ids[r], ws[r] = i, w * scale
    return torch.from_numpy(ids), torch.from_numpy(ws)


ROUTERS = [  # e, k, mode, norm_topk, routed_scale, score bias, logit bias, n_groups, topk_groups, group_score
    (64, 8, "softmax", True, 1.0, False, False, 1, 1, "max"),
    (60, 4, "softmax", False, 1.0, False, False, 1, 1, "max"),
    (32, 4, "topk_softmax", False, 1.0, False, True, 1, 1, "max"),
    (64, 6, "sigmoid", True, 2.5, True, False, 8, 3, "top2"),
    (60, 6, "softmax", True, 16.0, False, False, 4, 2, "max"),
    (64, 8, "sigmoid", False, 1.0, True, False, 1, 1, "max"),
]


@pytest.mark.parametrize("e,k,mode,norm,scale,sb,lb,ng,tg,gs", ROUTERS)
@pytest.mark.parametrize("b", [1, 3])
def test_route(e, k, mode, norm, scale, sb, lb, ng, tg, gs, b, launches):
    g = gen(e + k + b + ng)
    logits = torch.randn(b, e, generator=g) * 2
    score_b = torch.randn(e, generator=g) * 0.1 if sb else None
    logit_b = torch.randn(e, generator=g) if lb else None
    ids, w = dev(torch.empty(b, k, dtype=torch.int32)), dev(torch.empty(b, k))
    K.td.route(dev(logits), k, ids, w, mode=mode, norm_topk=norm, routed_scale=scale,
               score_bias=None if score_b is None else dev(score_b),
               logit_bias=None if logit_b is None else dev(logit_b), n_groups=ng, topk_groups=tg,
               group_score=gs)
    assert len(launches) == 1 and launches[0][1] == (b,)
    ids, w = ids.cpu().long(), w.cpu()
    spec = types.SimpleNamespace(n_experts_used=k, router=mode, n_groups=ng, topk_groups=tg, group_score=gs,
                                 norm_topk=norm, routed_scale=scale)
    lw = types.SimpleNamespace(router_b=logit_b, score_b=score_b)
    w_ref, ids_ref = ref_route(ReferenceOps(), logits, lw, spec, logits=logits)
    assert torch.equal(ids, ids_ref)
    assert (w - w_ref).abs().max() <= 1e-6 * scale
    ids64, w64 = route64(logits, k, mode, norm, scale, score_b, logit_b, ng, tg, gs)
    assert torch.equal(ids, ids64)
    assert (w.double() - w64).abs().max() <= 1e-6 * scale


# ------------------------------------------------------------------------------------------ embeddings


EMBED = [QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, QType.MXFP4, QType.F32,
         QType.F16, QType.BF16]


@pytest.mark.parametrize("qtype", EMBED, ids=lambda q: q.name)
@pytest.mark.parametrize("b", [1, 3])
def test_embed_rows(qtype, b, launches):
    v, h = 11, 512 if qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS) else 96
    g = gen(int(qtype) + b)
    if qtype in (QType.F32, QType.F16, QType.BF16):
        dtype = {QType.F32: torch.float32, QType.F16: torch.float16}.get(qtype, torch.bfloat16)
        table = QTensor.from_float(torch.randn(v, h, generator=g).to(dtype))
    elif qtype in (QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.Q6_K):
        table = QTensor.from_bytes(quantize(torch.randn(v, h, generator=g) * 0.05, qtype), qtype, (v, h))
    else:
        table = QTensor.from_bytes(qblocks.random_blocks(qtype, v, h, g, kq_scale=1e-4), qtype, (v, h))
    tokens = torch.tensor([10, 3, 10][:b], dtype=torch.int32)
    out = dev(torch.full((b, h), float("nan")))
    K.td.embed_rows(dev(tokens), QTensor(dev(table.data), qtype, (v, h)), out)
    assert len(launches) == 1
    ref = table.dequantize(torch.float32)[tokens.long()]
    assert torch.allclose(out.cpu(), ref, rtol=1e-6, atol=0)
    oracle = torch.from_numpy(np.asarray(gguf_dequantize(table.data.numpy(), qtype), dtype=np.float32))
    assert torch.allclose(out.cpu(), oracle.reshape(v, h)[tokens.long()], rtol=1e-6, atol=0)


def test_embed_rows_out_of_range_token_gives_zeros():
    table = QTensor.from_float(torch.randn(4, 64, generator=gen(5)))
    out = dev(torch.full((2, 64), float("nan")))
    tokens = dev(torch.tensor([1, 4], dtype=torch.int64))
    K.td.embed_rows(tokens, QTensor(dev(table.data), QType.F32, (4, 64)), out)
    assert torch.equal(out.cpu()[0], table.dequantize()[1]) and not out.cpu()[1].any()


# ------------------------------------------------------------------------------------------ norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b", [1, 3])
def test_rms_norms(dtype, b, launches):
    """Elementwise against layers.rms_norm (float32: float32 rounding; bfloat16: two units in the last place,
    the interpreter truncating) and normwise against float64."""
    h, eps = 96, 1e-5
    g = gen(b)
    x = torch.randn(b, h, generator=g).to(dtype) * 3
    delta = torch.randn(b, h, generator=g).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    rtol = 2e-6 if dtype == torch.float32 else 2 ** -6

    def check(out, x):
        ref = rms_norm(x, w, eps).float()
        assert torch.allclose(out.cpu().float(), ref, rtol=rtol, atol=1e-6)
        assert (out.cpu().double() - norm64(x, w, eps)).abs().max() <= rtol * ref.abs().max()

    out = dev(torch.empty(b, h, dtype=dtype))
    K.td.rms_norm(dev(x), dev(w), eps, out)
    check(out, x)
    xd = dev(x.clone())
    K.td.add_rms_norm(xd, dev(delta), dev(w), eps, out)
    assert same(xd.cpu(), x + delta)
    check(out, xd.cpu())
    assert len(launches) == 2 and all(grid == (b,) for _, grid, _ in launches)


# ------------------------------------------------------------------------------------------ rules


def test_wrappers_allocate_nothing_with_buffers(monkeypatch, launches):
    """Given every output and workspace buffer, no wrapper allocates (kernels recorded, not run)."""
    b, nh, nkv, d = 2, 4, 2, 32
    qkv = dev(torch.randn(b, (nh + 2 * nkv) * d))
    kc, vc = dev(torch.zeros(16, nkv, d)), dev(torch.zeros(16, nkv, d))
    ints = dev(torch.zeros(b, dtype=torch.int32))
    q_out, out = dev(torch.empty(b, nh, d)), dev(torch.empty(b, nh * d))
    table, inv = dev(torch.zeros(b, 4, dtype=torch.int32)), dev(rope_frequencies(d, 1e4))
    ws = K.ta.attention_workspace(b, nh, nkv, d, 2, DEVICE)
    logits, wts = dev(torch.randn(b, 16)), dev(torch.empty(b, 2))
    ids = dev(torch.empty(b, 2, dtype=torch.int32))
    emb = QTensor.from_bytes(dev(quantize(torch.randn(4, 64), QType.Q8_0)), QType.Q8_0, (4, 64))
    x, w, eo = dev(torch.randn(b, 64)), dev(torch.randn(64)), dev(torch.empty(b, 64))
    monkeypatch.setattr(device, "launch", lambda kernel, grid, *a, **kw: launches.append((kernel, grid, kw)))

    def refuse(*a, **kw):
        raise AssertionError("allocated")

    for name in ("empty", "zeros", "full", "tensor", "empty_like", "zeros_like", "ones", "arange"):
        monkeypatch.setattr(torch, name, refuse)
    K.td.qk_rope_kv_write(qkv, ints, ints, kc, vc, q_out, n_heads=nh, n_kv_heads=nkv, head_dim=d,
                          inv_freq=inv)
    K.td.decode_attention(q_out, kc, vc, table, ints, out, scale=0.1, block_size=4, splits=2, workspace=ws)
    K.td.route(logits, 2, ids, wts)
    K.td.embed_rows(ints, emb, eo)
    K.td.rms_norm(x, w, 1e-6, eo)
    K.td.add_rms_norm(x, eo, w, 1e-6, eo)
    assert len(launches) == 6


def test_a_step_captured_on_the_standin_replays_on_new_inputs():
    """Embedding, norm, q/k/v, attention (split), residual + norm and routing of a batch captured as one graph
    on the stand-in: no sync, one Triton launch each and no other kernel; replayed after the inputs change
    (tokens, positions, slots, lengths, q/k/v, logits) it gives what the kernels give when called anew."""
    b, nh, nkv, d, h, e, k, bs = 3, 4, 2, 16, 64, 16, 4, 4
    g = gen(21)
    emb = QTensor.from_bytes(quantize(torch.randn(40, h, generator=g) * 0.05, QType.Q8_0), QType.Q8_0,
                             (40, h))
    w, inv = torch.randn(h, generator=g), rope_frequencies(d, 1e4)
    kc, vc = torch.randn(64, nkv, d, generator=g), torch.randn(64, nkv, d, generator=g)
    table = torch.randperm(16, generator=g)[:3 * 4].view(3, 4).to(torch.int32)
    ws = K.ta.attention_workspace(b, nh, nkv, d, 2, "cpu")

    def inputs(seed):
        gi = gen(seed)
        lengths = torch.randint(1, 16, (b,), generator=gi, dtype=torch.int32)
        pos = lengths - 1
        slots = (table.gather(1, (pos // bs)[:, None].long())[:, 0] * bs + pos % bs).to(torch.int32)
        return [torch.randint(0, 40, (b,), generator=gi, dtype=torch.int32), pos, slots, lengths,
                torch.randn(b, (nh + 2 * nkv) * d, generator=gi), torch.randn(b, e, generator=gi)]

    def step(tokens, pos, slots, lengths, qkv, logits, o):
        x, xn, q, att, ids, wts, kcache, vcache = o
        K.td.embed_rows(tokens, emb, x)
        K.td.rms_norm(x, w, 1e-6, xn)
        K.td.qk_rope_kv_write(qkv, pos, slots, kcache, vcache, q, n_heads=nh, n_kv_heads=nkv, head_dim=d,
                              inv_freq=inv)
        K.td.decode_attention(q, kcache, vcache, table, lengths, att, scale=0.25, block_size=bs, splits=2,
                              workspace=ws)
        K.td.add_rms_norm(x, att, w, 1e-6, xn)
        K.td.route(logits, k, ids, wts, norm_topk=True)

    def buffers():
        return [torch.empty(b, h), torch.empty(b, h), torch.empty(b, nh, d), torch.empty(b, nh * d),
                torch.empty(b, k, dtype=torch.int32), torch.empty(b, k), kc.clone(), vc.clone()]

    with standin.fresh(seed=1):
        sd = device.parse("standin:0")
        ins, outs = inputs(1), buffers()
        graph = device.Graph(sd)
        with device.use(sd), device.counting(sd) as c, graph.capture():
            step(*ins, outs)
        assert c.n_syncs == 0 and c.n_triton == 6 and c.n_launches == 6, (c.syncs, c.launches)
        assert graph.kernels == 6
        new = inputs(2)
        for t, n in zip(ins, new):
            t.copy_(n)
        outs[6].copy_(kc)
        outs[7].copy_(vc)
        graph.replay()
    fresh = buffers()
    step(*new, fresh)
    for a, f in zip(outs, fresh):
        assert torch.equal(a, f)


def test_no_host_synchronisation_in_the_source():
    """No call that waits for the device, no CUDA call, no launch but through moerun.device.launch."""
    for mod in (K.ta, K.td):
        src = inspect.getsource(mod)
        for bad in (".item(", ".tolist(", ".cpu(", "nonzero", "bincount", "torch.cuda", "synchronize",
                    "][grid]", ".numpy(", "masked_select"):
            assert bad not in src, f"{mod.__name__}: {bad}"


@pytest.mark.slow
def test_ptx_cases_compile_for_sm90_and_sm86():
    """Every ptx_cases() entry of both modules compiles for an H100/H200 (sm_90) and an A10/3090 (sm_86) with
    triton's bundled compiler (no GPU needed), in a process where triton was never interpreted, as its wrapper
    launches it (ptx_options); on sm_90 none spills registers to the stack (cuobjdump -res-usage)."""
    code = (
        "import os, re, subprocess, tempfile\n"
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from moerun.kernels import triton_attn, triton_decode\n"
        "tools = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin')\n"
        "cuobjdump = os.path.join(tools, 'cuobjdump')\n"
        "n, spills = 0, []\n"
        "for arch in (90, 86):\n"
        "    for mod in (triton_attn, triton_decode):\n"
        "        for case in mod.ptx_cases():\n"
        "            name, fn, sig, consts = case\n"
        "            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts),\n"
        "                               target=GPUTarget('cuda', arch, 32), options=mod.ptx_options(case))\n"
        "            assert 'ptx' in k.asm and len(k.asm['cubin']) > 0, name\n"
        "            n += 1\n"
        "            if arch == 90 and os.path.exists(cuobjdump):\n"
        "                with tempfile.NamedTemporaryFile(suffix='.cubin') as f:\n"
        "                    f.write(k.asm['cubin'])\n"
        "                    f.flush()\n"
        "                    use = subprocess.run([cuobjdump, '-res-usage', f.name], capture_output=True,\n"
        "                                         text=True).stdout\n"
        "                stack = re.search(r'STACK:(\\d+)', use)\n"
        "                if stack and int(stack[1]):\n"
        "                    spills.append((name, use.split('Resource usage:')[-1].strip()))\n"
        "assert not spills, spills\n"
        "print(n)\n")
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                         check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    assert int(res.stdout.split()[-1]) == 2 * (len(K.ta.ptx_cases()) + len(K.td.ptx_cases()))
    names = [c[0] for c in K.ta.ptx_cases() + K.td.ptx_cases()]
    assert len(names) == len(set(names)) and all(len(c) == 4 for c in K.ta.ptx_cases() + K.td.ptx_cases())
