"""moerun.kernels.cpu (the C extension) against torch references: x @ w.dequantize().T, and for moe_ffn the
float MoE combine (the computation moerun's reference ops run over ResidentExperts' experts, restated here).

Two references per matmul: the float one (error bounded by the activations' 8-bit rounding, < 2%), and an
emulation of that rounding in torch (Q8_K per 256 values, Q8_0-style per 32), which the kernels must
match to float accumulation error. Weights come from moerun.quant.quantize where a quantizer exists and
from random bytes with sane scales otherwise.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from qblocks import random_blocks

from moerun.experts.store import Expert
from moerun.model.ops import ExpertFn
from moerun.quant.qtypes import QTensor, QType, block_size
from moerun.quant.quantize import quantize

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="moerun.kernels._cpu not built or disabled")

QTYPES = [QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.Q5_1, QType.IQ4_XS, QType.IQ4_NL,
          QType.MXFP4]
K_QUANTS = {QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K}
QUANTIZABLE = {QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.Q4_0}
TOKENS = (1, 2, 3, 5, 17, 64)
ISAS = cpu.features()["isas"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def shapes(qtype: QType) -> list[tuple[int, int]]:
    """(N, K): one block, a few blocks, the a3b hidden size, and (for 32-blocks) K % 256 != 0."""
    elems = block_size(qtype)[0]
    odd_k = 1024 + 3 * 32 if elems == 32 else 768
    return [(1, elems), (7, 4 * elems if elems == 32 else 512), (64, 2048), (300, odd_k)]


# ------------------------------------------------------------------------------------------ weights


@functools.cache
def weight(qtype: QType, rows: int, cols: int, seed: int = 0, random_bytes: bool = False) -> QTensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rows + cols + int(qtype))
    if qtype in QUANTIZABLE and not random_bytes:
        data = quantize(torch.randn(rows, cols, generator=gen) * 0.05, qtype)
    else:
        data = random_blocks(qtype, rows, cols, gen)
    return QTensor.from_bytes(data, qtype, (rows, cols))


@functools.cache
def dequantized(qtype: QType, rows: int, cols: int) -> torch.Tensor:
    return weight(qtype, rows, cols).dequantize().double()


def emulate_act(x: torch.Tensor, qtype: QType) -> torch.Tensor:
    """x after the kernels' activation rounding: per block d = absmax / 127, q = round(x * (127 / absmax))."""
    n = 256 if qtype in K_QUANTS else 32
    xb = x.reshape(-1, n)
    amax = xb.abs().amax(-1, keepdim=True)
    # 127 / amax as one true division, as the C code (a Python scalar over a tensor is a reciprocal times 127
    # in torch, 1 ulp off at times, which flips the rounding of a value at x.5)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)  # float32 product, half to even: as the C code
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_isas_agree(outs: dict[str, torch.Tensor], tol: float) -> None:
    """Every kernel set computes the same integer sums: the SIMD ones differ from the portable one only
    by float summation order, and AVX-512 VNNI runs AVX2's float operations exactly."""
    for isa, y in outs.items():
        assert rel_err(y, outs["scalar"]) < tol, isa
    if "avx2" in outs and "avx512vnni" in outs:
        assert torch.equal(outs["avx2"], outs["avx512vnni"])


# ------------------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape_i", range(4))
def test_matmul_matches_reference(qtype, shape_i):
    N, K = shapes(qtype)[shape_i]
    w, wd = weight(qtype, N, K), dequantized(qtype, N, K)
    gen = torch.Generator().manual_seed(N + K)
    for T in TOKENS:
        x = torch.randn(T, K, generator=gen)
        ref = x.double() @ wd.T
        ref_q = emulate_act(x, qtype) @ wd.T
        outs = {isa: cpu.matmul(x, w, isa=isa) for isa in ISAS}
        scale = (x.abs().double() @ wd.abs().T).norm()  # the products' size: a one-block sum may cancel to ~0
        for isa, y in outs.items():
            assert y.shape == (T, N) and y.dtype == torch.float32
            assert (y.double() - ref).norm() / scale < 0.01, (isa, T)  # the activations' 8-bit rounding
            assert rel_err(y, ref_q) < 2e-5, (isa, T)
        check_isas_agree(outs, 2e-6)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_activation_quantizers_agree_bytewise(qtype):
    from moerun.kernels import _cpu

    K = 2048
    x = torch.randn(5, K) * torch.logspace(-3, 3, 5)[:, None]
    x[1, :256] = 0  # an all-zero block
    nbytes = _cpu.act_row_bytes(int(qtype), K)
    outs = []
    for isa in ISAS:
        out = torch.empty(5, nbytes, dtype=torch.uint8)
        _cpu.quantize_act(cpu.ISA_IDS[isa], int(qtype), x.data_ptr(), 5, K, out.data_ptr())
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_q8_0_weights_of_minus_128():
    """-128 (which Q8_0 files may hold) goes through the sign trick as 128."""
    N, K = 3, 64
    raw = torch.full((N * K // 32, 34), 0x80, dtype=torch.uint8)  # every weight -128
    raw[:, 0:2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    w = QTensor.from_bytes(raw, QType.Q8_0, (N, K))
    x = torch.randn(2, K)
    ref = emulate_act(x, QType.Q8_0) @ w.dequantize().double().T
    for isa in ISAS:
        assert rel_err(cpu.matmul(x, w, isa=isa), ref) < 1e-5


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.MXFP4])
@pytest.mark.parametrize("interleaved", [False, True])
def test_dot_passes_give_the_matmul_products(qtype, interleaved):
    """The kernel-rate probe (readbw.c's qk_dot_passes, bench/gemv_layouts.py) runs the very products of a
    one-token matmul, and refuses what it cannot run."""
    from moerun.kernels import _cpu

    w = weight(qtype, 64, 2048)
    if interleaved:
        if not cpu.can_interleave(w):
            pytest.skip(f"{qtype.name} has no interleaved layout")
        w = cpu.interleave(w)
    x = torch.randn(1, 2048)
    out = torch.empty(64)
    _cpu.dot_passes(cpu._isa(None), cpu._type(w), w.data.data_ptr(), 64, 2048, x.data_ptr(), 3, out.data_ptr())
    assert torch.equal(out, cpu.matmul(x, w)[0])
    with pytest.raises(ValueError):
        _cpu.dot_passes(cpu._isa(None), cpu._type(w), w.data.data_ptr(), 64, 2048 + 7, x.data_ptr(), 1,
                        out.data_ptr())
    with pytest.raises(ValueError):
        _cpu.dot_passes(cpu._isa(None), 9999, w.data.data_ptr(), 64, 2048, x.data_ptr(), 1, out.data_ptr())


def test_matmul_zero_rows_and_no_tokens():
    w = weight(QType.Q4_K, 7, 512)
    x = torch.zeros(3, 512)
    assert torch.equal(cpu.matmul(x, w), torch.zeros(3, 7))
    assert cpu.matmul(torch.zeros(0, 512), w).shape == (0, 7)


def test_matmul_random_byte_kquants():
    """Q4_K and Q6_K from random bytes: every scale / min bit pattern, not just the quantizer's."""
    for qtype in (QType.Q4_K, QType.Q6_K):
        w = weight(qtype, 64, 1024, random_bytes=True)
        x = torch.randn(5, 1024)
        ref_q = emulate_act(x, qtype) @ w.dequantize().double().T
        for isa in ISAS:
            assert rel_err(cpu.matmul(x, w, isa=isa), ref_q) < 2e-5


# ------------------------------------------------------------------------------------------ moe_ffn


def experts(qtypes: tuple[QType, QType, QType], E: int, H: int, I: int) -> tuple[QTensor, QTensor, QTensor]:
    out = []
    for i, (qt, rows, cols) in enumerate(zip(qtypes, (I, I, H), (H, H, I))):
        ws = [weight(qt, rows, cols, seed=10 * i + e) for e in range(E)]
        out.append(QTensor(torch.stack([w.data for w in ws]), qt, (E, rows, cols)))
    return tuple(out)


MOE_CASES = [
    (QType.Q4_K, QType.Q4_K, QType.Q6_K),  # a Q4_K_M layer
    (QType.Q8_0, QType.Q4_0, QType.Q4_K),  # gate and up with different activation formats
    (QType.IQ4_XS, QType.MXFP4, QType.Q5_K),
    (QType.Q6_K, QType.Q5_K, QType.Q8_0),
]


def reference_moe(x, ids, w, experts: dict[int, Expert]) -> torch.Tensor:
    """sum over each token's k choices of w * down(silu(gate x) * up x), weights dequantized, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in sorted(experts):
        tok, slot = torch.where(ids == e)
        ex = experts[e]
        xe = x[tok].double()
        h = F.silu(xe @ ex.gate.dequantize().double().T) * (xe @ ex.up.dequantize().double().T)
        out.index_add_(0, tok, (h @ ex.down.dequantize().double().T) * w[tok, slot, None].double())
    return out


def emulate_moe(x, ids, w, gate, up, down) -> torch.Tensor:
    """combine() with the kernels' rounding of x (per gate / up format) and of h (per down format)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        g = (emulate_act(x[tok], gate.qtype) @ gate[e].dequantize().double().T).float()
        u = (emulate_act(x[tok], up.qtype) @ up[e].dequantize().double().T).float()
        h = g / (1 + torch.exp(-g)) * u  # float32, as the kernel
        y = emulate_act(h, down.qtype) @ down[e].dequantize().double().T
        out.index_add_(0, tok, y * w[tok, slot, None].double())
    return out


def routing(T: int, k: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[0] = ids[0, 0]  # token 0 picks the same expert k times
    if T > 4:
        ids[1:5, 1] = 3  # several tokens share expert 3 in the same slot
    w = torch.softmax(torch.randn(T, k, generator=gen), -1)
    return ids, w


@pytest.mark.parametrize("qtypes", MOE_CASES, ids=lambda c: "-".join(q.name for q in c))
@pytest.mark.parametrize("T", [1, 64])
def test_moe_ffn_matches_resident_experts(qtypes, T):
    E, H, I, k = 8, 512, 256, 4
    gate, up, down = experts(qtypes, E, H, I)
    ids, w = routing(T, k, E, seed=T)
    x = torch.randn(T, H)
    per_expert = {e: Expert(gate[e], up[e], down[e]) for e in range(E)}
    ref = reference_moe(x, ids, w, {e: per_expert[e] for e in torch.unique(ids).tolist()})
    ref_q = emulate_moe(x, ids, w, gate, up, down)
    outs = {isa: cpu.moe_ffn(x, ids, w, gate, up, down, isa=isa) for isa in ISAS}
    for isa, y in outs.items():
        assert y.shape == (T, H) and y.dtype == torch.float32
        # two roundings (x to 8 bits, then h to 8 bits): measured 0.9-1.9 % against the float reference
        assert rel_err(y, ref) < 0.03, isa
        assert rel_err(y, ref_q) < 1e-3, isa  # float order can flip a rounding of h
    check_isas_agree(outs, 1e-3)  # float order can flip a rounding of h (measured up to 3e-4)
    best = outs[cpu.features()["isa"]]
    assert torch.equal(cpu.moe_ffn(x, ids.int(), w, gate, up, down), best)
    # the same experts as separate buffers (only the routed ones given)
    routed = {e: Expert(*(QTensor(q.data.clone(), q.qtype, q.shape) for q in (ex.gate, ex.up, ex.down)))
              for e, ex in per_expert.items() if e in ids}
    assert torch.equal(cpu.moe_ffn_experts(x, ids, w, routed), best)


@pytest.fixture
def threads():
    before = cpu.get_threads()
    yield
    cpu.set_threads(before)


def test_results_do_not_depend_on_thread_count(threads):
    w = weight(QType.Q4_K, 300, 2048)
    gate, up, down = experts(MOE_CASES[0], 8, 512, 256)
    x = torch.randn(17, 2048)
    xm = torch.randn(33, 512)
    ids, wts = routing(33, 4, 8, seed=5)
    outs = []
    for n in (1, 2, 3):
        cpu.set_threads(n)
        assert cpu.get_threads() == n
        outs.append((cpu.matmul(x, w), cpu.moe_ffn(xm, ids, wts, gate, up, down)))
    for a, b in outs[1:]:
        assert torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1])


@pytest.mark.parametrize("k", [1, 2])
def test_decode_down_parts_cover_every_row(threads, k):
    """A few tokens' down projection goes by expert in parts of its rows: with one or two experts routed, three
    threads and H = 544 (no multiple of the part count), every output row is still computed, as with one thread."""
    gate, up, down = experts((QType.Q8_0, QType.Q8_0, QType.Q6_K), 4, 544, 256)
    ids, wts = torch.tensor([[2, 0][:k]]), torch.tensor([[0.75, 0.25][:k]])
    x = torch.randn(1, 544)
    ref = emulate_moe(x, ids, wts, gate, up, down)
    outs = []
    for n in (1, 3):
        cpu.set_threads(n)
        outs.append(cpu.moe_ffn(x, ids, wts, gate, up, down))
        assert rel_err(outs[-1], ref) < 1e-3, n
        assert ((outs[-1].double() - ref).abs().max() / ref.abs().max()).item() < 1e-2, n  # every row, not the norm
    assert torch.equal(outs[0], outs[1])


def test_pool_trace_counts_jobs_by_task(threads):
    """pool.h's trace: per task name the jobs run while it is on, with the caller's share, wait and gaps (ns, none
    negative); switching it (on or off) starts the counts afresh, and nothing is kept while it is off."""
    from moerun.kernels import _cpu

    w = weight(QType.Q4_K, 256, 512)
    gate, up, down = experts(MOE_CASES[0], 8, 512, 256)
    ids, wts = routing(3, 2, 8, seed=2)
    x = torch.randn(3, 512)
    for n in (1, 2):
        cpu.set_threads(n)
        _cpu.pool_trace(True)
        try:
            cpu.matmul(x, w)
            cpu.matmul(x, w)
            cpu.moe_ffn(x, ids, wts, gate, up, down)
            rows = {r[0]: r[1:] for r in _cpu.pool_trace_rows()}
        finally:
            _cpu.pool_trace(False)
        assert rows["mm_task"][0] == 2 and rows["moe_gate_up_task"][0] == 1, (n, rows)
        assert rows["moe_down_expert_task"][0] == 1, (n, rows)
        assert all(v >= 0 for r in rows.values() for v in r) and rows["mm_task"][1] > 0, rows
        assert _cpu.pool_trace_rows() == []
        cpu.matmul(x, w)
        assert _cpu.pool_trace_rows() == []


# ------------------------------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_value_errors():
    w = weight(QType.Q4_K, 7, 512)
    x = torch.randn(2, 512)
    bad_matmul = [
        (x.double(), w), (x[:, :256], w), (x.T.contiguous().T, w), (x[0], w),
        (x, QTensor.from_float(torch.randn(7, 512))),
        (x, QTensor.from_bytes(torch.zeros(7, 2 * 84, dtype=torch.uint8), QType.Q2_K, (7, 512))),
    ]
    for args in bad_matmul:
        with pytest.raises(ValueError):
            cpu.matmul(*args)
    with pytest.raises(ValueError):
        cpu.matmul(x, w, isa="avx1024")
    with pytest.raises(TypeError):  # not a QTensor
        cpu.matmul(x, torch.randn(7, 512))

    gate, up, down = experts(MOE_CASES[0], 8, 512, 256)
    ids, wts = routing(2, 4, 8, seed=1)
    xm = torch.randn(2, 512)
    bad_moe = [
        {"x": xm.double()}, {"ids": ids.float()}, {"ids": ids[:, :2]}, {"weights": wts.long()},
        {"ids": ids + 8}, {"gate": down}, {"up": gate[0]},
        {"x": torch.randn(2, 256)}, {"ids": ids[:1], "weights": wts[:1]},
    ]
    for bad in bad_moe:
        args = {"x": xm, "ids": ids, "weights": wts, "gate": gate, "up": up, "down": down} | bad
        with pytest.raises(ValueError):
            cpu.moe_ffn(**args)
    routed = {e: Expert(gate[e], up[e], down[e]) for e in torch.unique(ids).tolist()}
    with pytest.raises(ValueError):  # a routed expert missing
        cpu.moe_ffn_experts(xm, ids, wts, dict(list(routed.items())[1:]) | {7: routed[ids[0, 0].item()]})
    with pytest.raises(ValueError):  # experts of different types
        cpu.moe_ffn_experts(xm, ids, wts, routed | {7: Expert(up[0], gate[0], up[1])})
    for n in (0, -1, 2.0):
        with pytest.raises(ValueError):
            cpu.set_threads(n)


@pytest.mark.parametrize("case", MOE_CASES[:2])
def test_moe_pairs_and_skipped_pairs(case):
    """Negative ids skip a pair; pairs=True gives each pair's weighted row; pairs split over two calls by expert
    and summed in choice order equal one call's sum bit for bit (the device stages' miss path relies on it)."""
    gate, up, down = experts(case, 8, 512, 256)
    ids, wts = routing(5, 3, 8, seed=4)
    x = torch.randn(5, 512)
    whole = cpu.moe_ffn(x, ids, wts, gate, up, down)
    assert torch.equal(cpu.moe_ffn(x, ids - 8, wts, gate, up, down), torch.zeros(5, 512))
    routed = {e: Expert(gate[e], up[e], down[e]) for e in range(8)}
    odd, even = ({e: routed[e] for e in range(r, 8, 2)} for r in (1, 0))
    rows = sum(cpu.moe_ffn_experts(x, torch.where(ids % 2 == r, ids, -1), wts, part, pairs=True)
               for r, part in ((1, odd), (0, even)))  # [15, H]; each pair in exactly one part
    assert rows.shape == (15, 512)
    acc = rows.view(5, 3, 512)[:, 0].clone()
    for j in (1, 2):
        acc += rows.view(5, 3, 512)[:, j]
    assert torch.equal(acc, whole)
    one = cpu.moe_ffn_experts(x, torch.where(ids == ids[2, 1], ids, -1), wts, routed, pairs=True)
    assert torch.equal(one[7], rows[7]) and one.count_nonzero(dim=1).tolist().count(0) == 15 - (ids == ids[2, 1]).sum()


def test_glu_activations_over_wide_gate_values():
    """silu(g) * u, vectorised in C (vexp.h), against torch in float64 over gate values far past exp's float range
    (|g| up to 120): through glu_down with an identity float32 down projection (the product read back exactly)."""
    g = torch.linspace(-120, 120, 2560).view(10, 256)
    u = torch.randn(10, 256)
    ref = F.silu(g.double()) * u.double()
    for isa in ISAS:
        out = cpu.glu_down(g.clone(), u, torch.eye(256), isa=isa)
        assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-30), isa


@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
def test_moe_activations_with_large_gate_values(act):
    """Both expert activations with gate and up values in the tens (past gpt-oss's clamp, where e^-g overflows a
    float for the plain one), against the kernels' roundings emulated with torch's activation in float64."""
    fn = ExpertFn(act=act)
    gate, up, down = experts((QType.Q8_0, QType.Q8_0, QType.Q8_0), 4, 256, 256)
    ids, w = routing(6, 2, 4, seed=1)
    x = torch.randn(6, 256) * 40
    out = cpu.moe_ffn(x, ids, w, gate, up, down, fn=None if fn.plain else fn)
    ref = torch.zeros(x.shape, dtype=torch.float64)
    gmax = 0.0
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        g = emulate_act(x[tok], QType.Q8_0) @ gate[e].dequantize().double().T
        u = emulate_act(x[tok], QType.Q8_0) @ up[e].dequantize().double().T
        gmax = max(gmax, g.abs().max().item())
        h = fn.glu(g, u).float()
        ref.index_add_(0, tok, (emulate_act(h, QType.Q8_0) @ down[e].dequantize().double().T) * w[tok, slot, None].double())
    assert gmax > 90
    assert rel_err(out, ref) < 1e-3


def test_supports_and_features():
    for qt in QTYPES:
        assert cpu.supports(qt) and cpu.supports(int(qt))
    assert not cpu.supports(QType.Q2_K) and not cpu.supports(QType.F32) and not cpu.supports(999)
    f = cpu.features()
    assert f["available"] and f["isa"] in f["isas"] and "scalar" in f["isas"] and f["threads"] >= 1


@pytest.mark.parametrize("mode", ["scalar", "off"])
def test_environment_switch(monkeypatch, mode):
    monkeypatch.setenv("MOERUN_KERNELS", mode)
    try:
        mod = importlib.reload(cpu)
        if mode == "off":
            assert not mod.available() and not mod.supports(QType.Q4_K)
            with pytest.raises(RuntimeError):
                mod.matmul(torch.randn(1, 512), weight(QType.Q4_K, 7, 512))
        else:
            assert mod.features()["isa"] == "scalar"
            w = weight(QType.Q4_K, 7, 512)
            x = torch.randn(3, 512)
            assert torch.equal(mod.matmul(x, w), mod.matmul(x, w, isa="scalar"))
    finally:
        monkeypatch.delenv("MOERUN_KERNELS")
        importlib.reload(cpu)


@pytest.mark.parametrize("streams,prefetch", [(1, 0), (3, 0), (8, 512)])
def test_read_bw_reads_every_byte(streams, prefetch):
    """The read-bandwidth probe's pattern covers each thread's share: its xor is the data's (up to the tail that
    does not fill a 64-byte line of every stream, which these sizes leave empty)."""
    from moerun.hostmem import host_empty

    threads = cpu.get_threads()
    n = 2 * streams * 64 * 100
    buf = host_empty(n)
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(streams)))
    cpu.set_threads(2)
    try:
        words = buf.view(torch.int64).numpy()
        want = int(np.bitwise_xor.reduce(words).astype(np.uint64))
        assert cpu.read_bw(buf, streams, prefetch) == want
    finally:
        cpu.set_threads(threads)
    with pytest.raises(ValueError):
        cpu.read_bw(buf[1:], 1, 0)


def test_matmuls_equal_separate_products():
    """cpu.matmuls: up to four matrices of one input in one call (quantized and float32 together) equal each
    matrix's own product (matmul; torch for float32), and a fifth is refused."""
    from moerun.kernels import cpu
    from moerun.quant.qtypes import QTensor, QType
    from moerun.quant.quantize import quantize

    if not cpu.available():
        pytest.skip("the C kernels are not built")
    g = torch.Generator().manual_seed(0)
    q8 = QTensor(quantize(torch.randn(64, 256, generator=g), QType.Q8_0).reshape(64, -1), QType.Q8_0, (64, 256))
    q4 = QTensor(quantize(torch.randn(32, 256, generator=g), QType.Q4_K).reshape(32, -1), QType.Q4_K, (32, 256))
    f32 = torch.randn(16, 256, generator=g)
    x = torch.randn(3, 256, generator=g)
    a, b, c = cpu.matmuls(x, [q8, q4, f32])
    assert torch.equal(a, cpu.matmul(x, q8)) and torch.equal(b, cpu.matmul(x, q4))
    assert (c - x @ f32.t()).abs().max() < 1e-4
    with pytest.raises(ValueError, match="1..4 matrices"):
        cpu.matmuls(x, [q8] * 5)
