"""moerun.kernels.triton_q (Triton, dequantizing GGUF blocks in registers) against the torch reference
dequantizer, gguf.quants.dequantize (an independent oracle) and ReferenceOps.

Without CUDA the kernels run in triton's CPU interpreter: TRITON_INTERPRET=1 is set for this module's
tests only (triton_q reads it at each call and rebuilds its kernels when it changes), so import order
with the rest of the suite does not matter. With CUDA the same tests run compiled.

Error bound. Activations are not quantized: the only error is float32 accumulation. For a matmul each
output is checked elementwise against a float64 product of the dequantized weights,
    |y - y64| <= TOL * (|x| @ |w|^T),    TOL = 1e-5
(the float32 summation bound is (number of sequential adds) * 2^-24 times that magnitude; a single
wrong weight among K = 1120 moves an output by ~1/K of it, 90x this bound). MoE outputs are checked
normwise, max|y - ref| <= TOL * max|ref|, against ReferenceOps in float64 and in float32.
Dequantization in the interpreter (no fused multiply-add) is bit-exact. References are computed on the
CPU (moerun.quant.dequant allocates its output there), from CPU copies when the kernels ran on CUDA.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import qblocks
import torch
from triton_env import interpreter

pytest.importorskip("triton")

from gguf.quants import dequantize as gguf_dequantize

from moerun.experts.store import Expert
from moerun.kernels import triton_q as tq
from moerun.model.gpu_ops import TritonOps
from moerun.model.layers import rms_norm
from moerun.model.ops import ExpertFn, ReferenceOps, sum_pairs
from moerun.quant.qtypes import QTensor, QType, block_size
from moerun.quant.quantize import quantize

TOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QTYPES = [QType.Q8_0, QType.Q4_K, QType.Q6_K, QType.Q5_K, QType.Q4_0, QType.IQ4_XS, QType.MXFP4]
QUANTIZABLE = {QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.Q6_K}


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    with interpreter():
        yield


# ------------------------------------------------------------------------------------------ weights


def random_blocks(qtype: QType, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Weights stay below ~1 (smaller K-quant scales than the CPU kernel tests use)."""
    return qblocks.random_blocks(qtype, rows, cols, gen, kq_scale=1e-4)


@functools.cache
def weight(qtype: QType, rows: int, cols: int, seed: int = 0, random_bytes: bool = False) -> QTensor:
    """A QTensor on DEVICE: quantized Gaussian weights where moerun has a quantizer, else random blocks."""
    gen = torch.Generator().manual_seed(seed * 7919 + rows * 31 + cols + int(qtype))
    if qtype in QUANTIZABLE and not random_bytes:
        data = quantize(torch.randn(rows, cols, generator=gen) * 0.05, qtype)
    else:
        data = random_blocks(qtype, rows, cols, gen)
    return QTensor.from_bytes(data.to(DEVICE), qtype, (rows, cols))


def on_cpu(q: QTensor) -> QTensor:
    return QTensor(q.data.cpu(), q.qtype, q.shape)


def cpu_experts(experts: dict[int, Expert]) -> dict[int, Expert]:
    return {e: Expert(on_cpu(ex.gate), on_cpu(ex.up), on_cpu(ex.down)) for e, ex in experts.items()}


def cols_for(qtype: QType) -> int:
    """A row length: two 256-blocks, or 35 32-blocks (not a multiple of 256) where the format allows."""
    return 512 if block_size(qtype)[0] == 256 else 1120


def activations(t: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def check_matmul(y: torch.Tensor, x: torch.Tensor, w: QTensor) -> float:
    """Asserts the elementwise bound; returns max err / magnitude."""
    assert y.dtype == x.dtype
    wd = on_cpu(w).dequantize().double()  # [N, K]
    x = x.cpu().double()
    ref = x @ wd.T  # [T, N]
    mag = x.abs() @ wd.abs().T  # [T, N]
    err = (y.cpu().double() - ref).abs()
    assert y.shape == ref.shape
    assert bool((err <= TOL * mag).all()), f"max err/magnitude {(err / mag.clamp_min(1e-30)).max().item():.3g}"
    return (err / mag.clamp_min(1e-30)).max().item()


def rel_max(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.cpu().double(), ref.cpu().double()
    return ((a - ref).abs().max() / ref.abs().max()).item()


# ------------------------------------------------------------------------------------------ dequant


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantize_matches_torch_reference_and_gguf(qtype):
    w = weight(qtype, 3, cols_for(qtype))
    got = tq.dequantize(w).cpu()
    ref = on_cpu(w).dequantize()
    oracle = torch.from_numpy(gguf_dequantize(w.data.cpu().numpy(), qtype).astype(np.float32)).view(3, -1)
    if tq.interpreting():  # no fused multiply-add: bit-exact
        assert torch.equal(got, ref)
        assert torch.equal(got, oracle)
    else:
        torch.testing.assert_close(got, ref, rtol=2e-7, atol=1e-7 * ref.abs().max().item())
        torch.testing.assert_close(got, oracle, rtol=2e-7, atol=1e-7 * ref.abs().max().item())


# ------------------------------------------------------------------------------------------ matmul


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("t, n", [(1, 1), (3, 7), (17, 33)])
def test_matmul_matches_reference(qtype, t, n):
    w = weight(qtype, n, cols_for(qtype))
    x = activations(t, w.shape[1])
    check_matmul(tq.matmul(x, w), x, w)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("t", [2, 5, 9, 16, 31, 64])
def test_matmul_token_counts(qtype, t):
    w = weight(qtype, 19, 256)
    x = activations(t, 256, seed=t)
    check_matmul(tq.matmul(x, w), x, w)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_matmul_device_tile_sizes(qtype, monkeypatch):
    """The GPU's tile table (small tiles, the tl.dot path at 16+ rows), run here by the interpreter."""
    monkeypatch.setattr(tq, "INTERPRETER_TILES", tq.TILES)
    w = weight(qtype, 33, cols_for(qtype))
    for t in (1, 2, 3, 8, 16, 20):
        x = activations(t, w.shape[1], seed=t)
        check_matmul(tq.matmul(x, w), x, w)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.MXFP4], ids=lambda q: q.name)
def test_matmul_reads_nothing_past_the_rows(qtype, monkeypatch):
    """The last tile of a row runs past K = 1120; the bytes after the tensor are 0xFF (an f16 NaN, the
    largest E8M0 exponent), so a read there would turn the output to NaN."""
    w = weight(qtype, 3, 1120)
    buf = torch.full((w.nbytes + 4096,), 0xFF, dtype=torch.uint8, device=DEVICE)
    buf[:w.nbytes] = w.data.reshape(-1)
    w = QTensor.from_bytes(buf[:w.nbytes], qtype, w.shape)
    x = activations(2, 1120)
    check_matmul(tq.matmul(x, w), x, w)
    monkeypatch.setattr(tq, "INTERPRETER_TILES", tq.TILES)
    check_matmul(tq.matmul(x, w), x, w)


def test_matmul_keeps_dtype_and_handles_no_tokens():
    w = weight(QType.Q8_0, 5, 64)
    assert tq.matmul(torch.empty(0, 64, device=DEVICE), w).shape == (0, 5)
    x = activations(3, 64)
    y = tq.matmul(x.to(torch.bfloat16), w)
    assert y.dtype == torch.bfloat16
    ref = x.to(torch.bfloat16).float().cpu() @ on_cpu(w).dequantize().T
    torch.testing.assert_close(y.float().cpu(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_matmul_rejects_bad_inputs():
    w = weight(QType.Q8_0, 5, 64)
    with pytest.raises(ValueError, match="features"):
        tq.matmul(activations(2, 32), w)
    f16 = QTensor.from_float(torch.zeros(5, 64, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="no Triton kernel"):
        tq.matmul(activations(2, 64), f16)


# ------------------------------------------------------------------------------------------ MoE


def make_experts(ids: list[int], qtypes: tuple[QType, QType, QType], h: int, i: int, random_bytes: bool = False
                 ) -> dict[int, Expert]:
    g, u, d = qtypes
    return {e: Expert(weight(g, i, h, 3 * e, random_bytes), weight(u, i, h, 3 * e + 1, random_bytes),
                      weight(d, h, i, 3 * e + 2, random_bytes)) for e in ids}


def reference_moe(x, ids, w, experts, dtype=torch.float64) -> torch.Tensor:
    """ReferenceOps.moe on the CPU in `dtype`."""
    return ReferenceOps().moe(x.cpu().to(dtype), ids.cpu(), w.cpu().to(dtype), cpu_experts(experts))


def routing(t: int, k: int, n_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(t)])  # [T, k]
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)  # [T, k]
    return ids.to(DEVICE), w.to(DEVICE)


def check_moe(qtypes, h: int, i: int, t: int, k: int) -> float:
    """Experts 0, 2, 3, 5, 6 of 8 are given: choices of 1, 4 and 7 add nothing (as in ReferenceOps)."""
    experts = make_experts([0, 2, 3, 5, 6], qtypes, h, i)
    x = activations(t, h, seed=t)
    ids, w = routing(t, k, 8, seed=t)
    y = tq.moe_ffn(x, ids, w, experts)
    ref32 = reference_moe(x, ids, w, experts, torch.float32)
    ref64 = reference_moe(x, ids, w, experts)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_max(y, ref64) <= TOL and rel_max(y, ref32) <= TOL
    return rel_max(y, ref64)


@pytest.mark.parametrize("t, k", [(1, 2), (3, 4), (17, 2)])
def test_moe_q8_0_matches_reference(t, k):
    check_moe((QType.Q8_0,) * 3, 64, 96, t, k)


@pytest.mark.parametrize("t", [1, 6])
def test_moe_q4_k_m_matches_reference(t):
    """Q4_K_M's mix: gate and up Q4_K, down Q6_K."""
    check_moe((QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 256, t, 3)


def test_moe_gate_and_up_of_different_types():
    check_moe((QType.Q4_K, QType.Q5_K, QType.Q8_0), 256, 256, 4, 2)


def test_moe_device_tile_sizes(monkeypatch):
    monkeypatch.setattr(tq, "INTERPRETER_TILES", tq.TILES)
    for t in (1, 20):  # one row per expert (GEMV tiles); ~8 rows per expert
        check_moe((QType.Q8_0,) * 3, 64, 64, t, 2)


def test_moe_no_routed_expert_given():
    experts = make_experts([2], (QType.Q8_0,) * 3, 64, 32)
    x = activations(3, 64)
    y = tq.moe_ffn(x, torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), torch.ones(3, 1, device=DEVICE), experts)
    assert torch.equal(y, torch.zeros_like(x))


def test_moe_rejects_mixed_experts():
    experts = make_experts([0], (QType.Q8_0,) * 3, 64, 32) | make_experts([1], (QType.Q4_0,) * 3, 64, 32)
    ids, w = routing(2, 2, 2, seed=0)
    with pytest.raises(ValueError, match="experts\\[1\\].gate"):
        tq.moe_ffn(activations(2, 64), ids, w, experts)


@pytest.mark.parametrize("bm", [1, 4, 32])
def test_schedule_covers_each_pair_once(bm):
    """The tile table (built on the device, no host sync) for prefill-sized routing: every pair with a
    given expert lies in exactly one tile of at most BM rows of that expert; the others in none."""
    keys = sorted(torch.randperm(128, generator=torch.Generator().manual_seed(bm))[:37].tolist())
    ids, _ = routing(300, 8, 128, seed=bm)
    pair, (table, _) = tq._schedule(ids, keys, tq._lut(keys, ids.device), {"BM": bm})
    slot_of = {e: s for s, e in enumerate(keys)}
    want = {p: slot_of[e] for p, e in enumerate(ids.reshape(-1).tolist()) if e in slot_of}
    seen = {}
    for s, r0, r1 in table.tolist():
        if s < 0:
            continue
        assert 0 < r1 - r0 <= bm
        for p in pair[r0:r1].tolist():
            assert p not in seen and want[p] == s
            seen[p] = s
    assert seen == want


# ------------------------------------------------------------------------------------------ options


def launches(monkeypatch) -> list:
    """The names of the Triton kernels launched (every launch goes through moerun.device.launch)."""
    from moerun import device

    seen, real = [], device.launch
    monkeypatch.setattr(device, "launch", lambda k, g, *a, **kw: seen.append(k.__name__) or real(k, g, *a, **kw))
    return seen


def ref_linear(x, w, b=None) -> torch.Tensor:
    return ReferenceOps().linear(x.cpu().double(), on_cpu(w), None if b is None else b.cpu().double())


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.MXFP4], ids=lambda q: q.name)
@pytest.mark.parametrize("t", [1, 3, 20])
def test_matmul_norm_bias_accumulate(qtype, t, monkeypatch):
    """(rms_norm(x) * nw) @ w^T + b added into a residual, one launch, against the reference's separate steps."""
    seen = launches(monkeypatch)
    w = weight(qtype, 37, cols_for(qtype))
    k = w.shape[1]
    x, nw = activations(t, k, seed=2), activations(1, k, seed=3).reshape(k)
    b, resid = activations(1, 37, seed=4).reshape(37), activations(t, 37, seed=5)
    out = resid.clone()
    got = tq.matmul(x, w, norm=(nw, 1e-6), bias=b, out=out, accumulate=True)
    assert got is out and seen == ["qgemm_kernel"]
    xn = rms_norm(x.cpu().double(), nw.cpu().double(), 1e-6)
    assert rel_max(out - resid, ref_linear(xn, w, b)) <= TOL
    check_matmul(tq.matmul(x, w, norm=(torch.ones(k, device=DEVICE), 1e-6)) , rms_norm(x, torch.ones(k, device=DEVICE), 1e-6), w)


@pytest.mark.parametrize("t", [1, 5, 17])
def test_matmul_multi_side_by_side(t, monkeypatch):
    seen = launches(monkeypatch)
    ws = [weight(QType.Q4_K, n, 512, seed=n) for n in (40, 8, 8, 3)]
    x = activations(t, 512, seed=t)
    bias = activations(1, 8, seed=9).reshape(8)
    y = tq.matmul_multi(x, ws, biases=[None, bias, None, None])
    assert y.shape == (t, 59) and seen == ["qgemm_kernel"] * 2  # three weights per launch
    parts = y.split([40, 8, 8, 3], 1)
    for part, w, b in zip(parts, ws, [None, bias, None, None]):
        assert rel_max(part, ref_linear(x, w, b)) <= TOL
    seen.clear()
    qkv = ws[:3]
    y = tq.matmul_multi(x, qkv, norm=(torch.ones(512, device=DEVICE), 1e-5))
    assert seen == ["qgemm_kernel"]
    xn = rms_norm(x.cpu().double(), torch.ones(512, dtype=torch.float64), 1e-5)
    for part, w in zip(y.split([40, 8, 8], 1), qkv):
        assert rel_max(part, ref_linear(xn, w)) <= TOL
    with pytest.raises(ValueError, match="share type and K"):
        tq.matmul_multi(x, [ws[0], weight(QType.Q8_0, 8, 512)])


def test_swiglu_norm_into_residual(monkeypatch):
    seen = launches(monkeypatch)
    ex = make_experts([0], (QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 256)[0]
    x, nw = activations(3, 256), activations(1, 256, seed=7).reshape(256)
    resid = activations(3, 256, seed=8)
    out = resid.clone()
    tq.swiglu(x, ex.gate, ex.up, ex.down, norm=(nw, 1e-6), out=out, accumulate=True)
    assert seen == ["qgemm_kernel"] * 2
    cpu = cpu_experts({0: ex})[0]
    xn = rms_norm(x.cpu().double(), nw.cpu().double(), 1e-6)
    assert rel_max(out - resid, ReferenceOps().swiglu(xn, cpu.gate, cpu.up, cpu.down)) <= TOL


def oai_fn(n_experts: int, i: int, h: int, seed: int = 0) -> ExpertFn:
    gen = torch.Generator().manual_seed(seed)
    biases = tuple((torch.randn(n_experts, d, generator=gen) * 0.5).to(DEVICE) for d in (i, i, h))
    return ExpertFn("swiglu_oai", alpha=1.702, limit=1.5, biases=biases)


def cpu_fn(fn: ExpertFn, dtype=torch.float64) -> ExpertFn:
    return ExpertFn(fn.act, fn.alpha, fn.limit, tuple(b.cpu().to(dtype) for b in fn.biases))


@pytest.mark.parametrize("t", [1, 4, 17])
@pytest.mark.parametrize("qtypes", [(QType.Q8_0,) * 3, (QType.MXFP4,) * 3], ids=["Q8_0", "MXFP4"])
def test_moe_gptoss_activation_and_biases(qtypes, t, monkeypatch):
    """gpt-oss's clamped SwiGLU (a limit the values cross) and biases by expert id, in the kernels: the whole
    MoE in two launches up to 16 tokens (the pair rows in two as well), sorted above."""
    seen = launches(monkeypatch)
    experts = make_experts([0, 2, 3, 5, 6], qtypes, 64, 96)
    fn = oai_fn(8, 96, 64, seed=t)
    x = activations(t, 64, seed=t) * 3
    ids, w = routing(t, 3, 8, seed=t)
    y = tq.moe_ffn(x, ids, w, experts, fn=fn)
    ref = ReferenceOps().moe(x.cpu().double(), ids.cpu(), w.cpu().double(), cpu_experts(experts), fn=cpu_fn(fn))
    assert rel_max(y, ref) <= TOL
    pairs = tq.moe_ffn(x, ids, w, experts, fn=fn, pairs=True)
    ref_pairs = ReferenceOps().moe_pairs(x.cpu().double(), ids.cpu(), w.cpu().double(), cpu_experts(experts),
                                         fn=cpu_fn(fn))
    assert pairs.shape == (t * 3, 64) and rel_max(pairs, ref_pairs) <= TOL
    assert bool((pairs.cpu()[(~torch.isin(ids.cpu(), torch.tensor([0, 2, 3, 5, 6]))).reshape(-1)] == 0).all())
    if t <= tq.PAIRS_MAX:
        assert seen == ["moe_pair_kernel"] * 4
    else:
        assert seen.count("qgemm_kernel") == 4 and seen.count("sum_pairs_kernel") == 1


@pytest.mark.parametrize("t", [1, 3, 17])
def test_moe_into_residual_in_choice_order(t, monkeypatch):
    """out += the k choices' rows added in choice order (sum_pairs' order), into a residual."""
    seen = launches(monkeypatch)
    experts = make_experts([0, 1, 2, 3], (QType.Q8_0,) * 3, 64, 64)
    x = activations(t, 64, seed=t)
    ids, w = routing(t, 4, 4, seed=t)
    resid = activations(t, 64, seed=11)
    out = resid.clone()
    assert tq.moe_ffn(x, ids, w, experts, out=out, accumulate=True) is out
    pairs = tq.moe_ffn(x, ids, w, experts, pairs=True)
    assert torch.allclose(out, resid + sum_pairs(pairs, 4), rtol=0, atol=1e-6)
    assert rel_max(out - resid, reference_moe(x, ids, w, experts)) <= TOL
    assert len([n for n in seen if n == "moe_pair_kernel"]) == (4 if t <= tq.PAIRS_MAX else 0)


@pytest.mark.slow
def test_moe_pair_tiles_of_a_gpu(monkeypatch):
    """The pair kernel with a GPU's small tiles (BN 2..16), run here by the interpreter."""
    real = tq._pair_tiles
    monkeypatch.setattr(tq, "_pair_tiles", lambda *a, **kw: real(*a, **{**kw, "gpu": True}))
    check_moe((QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 256, 2, 3)


def test_decode_programs_and_warmup():
    assert tq.decode_programs(QType.Q4_K, 5120, 2048) == 640  # 8 rows a program
    assert tq.decode_programs(QType.Q4_K, 2048, 4096) == 1024  # 2 rows
    assert tq.decode_programs(QType.Q6_K, 151936, 2048) == 18992  # 8 rows
    assert tq.decode_programs(QType.Q4_K, 768, 2048, experts=8) == 768
    assert tq.decode_programs(QType.Q6_K, 2048, 768, experts=8, summed=True) == 1024
    launch = tq.Launch("moe", (QType.Q4_K,) * 3, 768, 2048, 1, frozenset({"accumulate"}), 8, 128)
    assert tq.warmup([launch], DEVICE) == (0 if tq.interpreting() else 2)


def test_decode_step_without_host_syncs_in_few_launches():
    """On the stand-in (which counts every device-to-host read and every launch, and records a capture as a
    CUDA graph would): q|k|v with the norm, o into the residual and the routed experts into the residual are
    four Triton launches, no torch kernel, no sync, for an ExpertTable built beforehand."""
    import inspect

    from moerun import device, standin

    ws = [weight(QType.Q4_K, n, 256, seed=n) for n in (64, 16, 16)]
    wo = weight(QType.Q8_0, 256, 64)
    experts = make_experts([0, 1, 2, 3], (QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 256)
    nw = torch.ones(256, device=DEVICE)
    x = activations(1, 256)
    ids, w = routing(1, 2, 4, seed=3)
    ids = ids.to(torch.int32)
    with standin.fresh(seed=1):
        sd = device.parse("standin:0")
        table = tq.ExpertTable(experts)
        graph = device.Graph(sd)
        with device.use(sd), device.counting(sd) as c, graph.capture():
            qkv = tq.matmul_multi(x, ws, norm=(nw, 1e-6))
            tq.matmul(qkv[:, :64], wo, out=x, accumulate=True)
            tq.moe_ffn(x, ids, w, experts, table=table, out=x, accumulate=True)
        assert c.n_syncs == 0 and c.n_launches == 4, (c.syncs, c.launches)
        assert c.launches["triton:moe_pair_kernel"] == 2 and graph.kernels == 4
    for mod in (tq, *tq._kernels()):
        src = inspect.getsource(mod)
        for bad in (".item(", ".tolist(", ".cpu(", "nonzero", "bincount", "torch.cuda", "synchronize", "][grid]",
                    "masked_select", ".numpy("):
            assert bad not in src, f"{mod.__name__}: {bad}"


# ------------------------------------------------------------------------------------------ TritonOps


def spy(monkeypatch, name: str) -> list:
    calls = []
    real = getattr(tq, name)
    monkeypatch.setattr(tq, name, lambda *a, **kw: calls.append(name) or real(*a, **kw))
    return calls


def test_triton_ops_linear(monkeypatch):
    ops, calls = TritonOps(), spy(monkeypatch, "matmul")
    w = weight(QType.Q6_K, 9, 256)
    x = activations(2, 256)
    b = torch.randn(9, device=DEVICE)
    y = ops.linear(x.view(1, 2, 256), w, b)
    assert calls == ["matmul"] and y.shape == (1, 2, 9)
    check_matmul(y.view(2, 9) - b, x, w)
    f32 = torch.randn(9, 256, device=DEVICE)
    torch.testing.assert_close(ops.linear(x, f32), x @ f32.T)  # plain tensor: the reference
    q4_1 = QTensor.from_bytes(random_blocks(QType.Q4_1, 9, 256, torch.Generator()).to(DEVICE), QType.Q4_1, (9, 256))
    if DEVICE == "cpu":  # the reference dequantizer runs on the CPU only
        torch.testing.assert_close(ops.linear(x, q4_1), ReferenceOps().linear(x, q4_1))  # no kernel for Q4_1
    assert calls == ["matmul"]


def test_triton_ops_moe_and_swiglu(monkeypatch):
    ops, moe_calls, swiglu_calls = TritonOps(), spy(monkeypatch, "moe_ffn"), spy(monkeypatch, "swiglu")
    experts = make_experts([1, 4], (QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 256)
    x = activations(3, 256)
    ids, w = routing(3, 2, 5, seed=9)
    assert rel_max(ops.moe(x, ids, w, experts), reference_moe(x, ids, w, experts)) <= TOL
    ex, cpu = experts[1], cpu_experts(experts)[1]
    ref = ReferenceOps().swiglu(x.cpu().double(), cpu.gate, cpu.up, cpu.down)
    assert rel_max(ops.swiglu(x, ex.gate, ex.up, ex.down), ref) <= TOL
    assert moe_calls == ["moe_ffn"] and swiglu_calls == ["swiglu"]


def test_triton_ops_linears_and_gptoss_moe(monkeypatch):
    """q|k|v in one launch; gpt-oss's experts in the kernels, checked once per ExpertTable (moe_table)."""
    ops, seen = TritonOps(), launches(monkeypatch)
    ws = [weight(QType.Q8_0, n, 64, seed=n) for n in (16, 8, 8)]
    x = activations(2, 64)
    for y, w in zip(ops.linears(x, ws), ws):
        assert rel_max(y, ref_linear(x, w)) <= TOL
    assert seen == ["qgemm_kernel"]
    experts = make_experts([1, 4], (QType.MXFP4,) * 3, 64, 64)
    fn = oai_fn(5, 64, 64)
    table = ops.moe_table(experts)
    built = spy(monkeypatch, "ExpertTable")
    ids, w = routing(2, 2, 5, seed=1)
    ref = ReferenceOps().moe(x.cpu().double(), ids.cpu(), w.cpu().double(), cpu_experts(experts), fn=cpu_fn(fn))
    seen.clear()
    assert rel_max(ops.moe(x, ids, w, experts, table, fn=fn), ref) <= TOL
    assert built == [] and seen == ["moe_pair_kernel"] * 2
    pairs = ops.moe_pairs(x, ids, w, experts, fn=fn)
    assert rel_max(sum_pairs(pairs, 2), ref) <= TOL and built == ["ExpertTable"]
    mixed = experts | make_experts([2], (QType.Q8_0,) * 3, 64, 64)
    assert ops.moe_table(mixed) is None  # reference loop


def test_triton_ops_falls_back_without_a_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not tq.available() and not tq.runs_on(torch.device("cpu"))
    w = QTensor.from_bytes(quantize(torch.randn(4, 64), QType.Q8_0), QType.Q8_0, (4, 64))
    x = torch.randn(2, 64)
    calls = spy(monkeypatch, "matmul")
    torch.testing.assert_close(TritonOps().linear(x, w), ReferenceOps().linear(x, w))
    assert calls == []


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from moerun.kernels import triton_q\n"
            "from moerun.model.gpu_ops import TritonOps\n"
            "from moerun.quant.qtypes import QTensor, QType\n"
            "from moerun.quant.quantize import quantize\n"
            "w = QTensor.from_bytes(quantize(torch.ones(2, 32), QType.Q8_0), QType.Q8_0, (2, 32))\n"
            "print(triton_q.available(), TritonOps().linear(torch.ones(1, 32), w).tolist())\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "False"


# ------------------------------------------------------------------------------------------ larger


@pytest.mark.slow
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_sweep(qtype):
    k = 2 * cols_for(qtype)
    for t, n in [(1, 65), (7, 130), (40, 97)]:
        w = weight(qtype, n, k, seed=5)
        x = activations(t, k, seed=n)
        check_matmul(tq.matmul(x, w), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 512])
def test_a3b_layer_on_cuda(t):
    """Qwen3-30B-A3B's expert shape (hidden 2048, FFN 768, 128 experts, top-8) in Q4_K_M, compiled."""
    assert not tq.interpreting() and DEVICE == "cuda"
    ids, w = routing(t, 8, 128, seed=t)
    used = sorted(set(ids.reshape(-1).tolist()))
    experts = make_experts(used, (QType.Q4_K, QType.Q4_K, QType.Q6_K), 2048, 768, random_bytes=True)
    x = activations(t, 2048, seed=t)
    assert rel_max(tq.moe_ffn(x, ids, w, experts), reference_moe(x, ids, w, experts)) <= TOL
    gate = experts[used[0]].gate
    check_matmul(tq.matmul(x, gate), x, gate)
