"""The CPU kernels' interleaved layouts (Q4_K_R8, Q5_K_R8, Q6_K_R8, Q8_0_R8, MXFP4_R8, IQ4_XS_R8, Q5_0_R8, Q5_1_R8,
IQ4_NL_R8: moerun/kernels/csrc/r8.c, dot_x86_r8.inc).

The layout only reorders bytes, so it is checked three ways: the round trip gives the file's bytes back for
any bytes; a matmul over it equals x @ W^T with W dequantized by gguf.quants from the original bytes (the
independent reference), to the activations' 8-bit rounding; and a model loaded with it gives the logits of
the same model loaded without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from qblocks import q5_k_from_q4_k, random_blocks

from moerun.experts.store import Expert
from moerun.quant.qtypes import QTensor, QType
from moerun.quant.quantize import quantize

cpu = pytest.importorskip("moerun.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="moerun.kernels._cpu not built or disabled")

ISAS = cpu.features()["isas"]
Q4K = QType.Q4_K
QTYPES = pytest.mark.parametrize("qt", [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.MXFP4, QType.IQ4_XS,
                                        QType.Q5_0, QType.Q5_1, QType.IQ4_NL, QType.Q3_K], ids=lambda q: q.name)
K_QUANTS = (QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K)  # activations in blocks of 256


def q4k(rows: int, cols: int, seed: int = 0, random_bytes: bool = False, lead: tuple[int, ...] = (),
        qt: QType = Q4K) -> QTensor:
    gen = torch.Generator().manual_seed(seed)
    n = int(np.prod(lead, dtype=np.int64)) * rows
    if random_bytes or qt in (QType.IQ4_XS, QType.IQ4_NL, QType.Q3_K):  # moerun does not quantize these: random blocks
        data = random_blocks(qt, n, cols, gen)
    elif qt == QType.Q5_K:  # nor Q5_K: Q4_K's blocks with a fifth bit
        data = q5_k_from_q4_k(quantize(torch.randn(n, cols, generator=gen) * 0.05, Q4K), gen)
    elif qt in (QType.Q5_0, QType.Q5_1):  # nor Q5_0 / Q5_1: gguf.quants' (llama-quantize's for rows K-quants cannot take)
        data = torch.from_numpy(quants.quantize((torch.randn(n, cols, generator=gen) * 0.05).numpy(), qt))
    else:
        data = quantize(torch.randn(n, cols, generator=gen) * 0.05, qt)
    return QTensor.from_bytes(data, qt, (*lead, rows, cols))


def gguf_dequant(w: QTensor) -> torch.Tensor:
    """gguf.quants' float weights of a GGUF-layout tensor: the reference, independent of moerun."""
    rows = w.data.reshape(-1, w.data.shape[-1]).numpy()
    return torch.from_numpy(quants.dequantize(rows, w.qtype)).reshape(w.shape).double()


def emulate_act(x: torch.Tensor, qt: QType = Q4K) -> torch.Tensor:
    """x after the kernels' activation rounding (d = absmax / 127 per 256 values for K-quants, per 32 for
    Q8_0; round half to even)."""
    xb = x.reshape(-1, 256 if qt in K_QUANTS else 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.round(xb * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)))
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------- layout


@QTYPES
@pytest.mark.parametrize("random_bytes", [False, True])
@pytest.mark.parametrize("shape", [(8, 256), (24, 768), (64, 2048)])
def test_round_trip_gives_the_file_bytes_back(shape, random_bytes, qt):
    w = q4k(*shape, seed=shape[0], random_bytes=random_bytes, qt=qt)
    il = cpu.interleave(w)
    assert il.interleave == 8 and il.shape == w.shape and il.data.shape == w.data.shape
    assert not torch.equal(il.data, w.data)  # really rearranged
    assert torch.equal(cpu.deinterleave(il).data, w.data)
    assert torch.equal(il.dequantize().double(), gguf_dequant(w))


@pytest.mark.parametrize("qt,block", [(Q4K, 144), (QType.Q5_K, 176), (QType.Q6_K, 210), (QType.Q5_0, 22),
                                      (QType.Q5_1, 24), (QType.IQ4_NL, 18), (QType.Q3_K, 110)],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "Q3_K"])
def test_any_bytes_round_trip(qt, block):
    """Every bit pattern: Q4_K's (and Q5_K's, Q3_K's) 12 packed scale bytes -> 6-bit values and back is one to one; Q5_K's,
    Q5_0's and Q5_1's fifth bits (and Q5_1's m), Q6_K's low and high bits of each weight, its int8 scales and d land
    in one place each."""
    raw = torch.randint(0, 256, (16, block * 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    w = QTensor.from_bytes(raw, qt, (16, 2 * (32 if qt in (QType.Q5_0, QType.Q5_1, QType.IQ4_NL) else 256)))
    assert torch.equal(cpu.deinterleave(cpu.interleave(w)).data, raw)


@QTYPES
def test_stacked_experts_interleave_per_expert(qt):
    w = q4k(16, 512, seed=3, lead=(5,), qt=qt)
    il = cpu.interleave(w)
    for e in range(5):  # each expert's slice is that expert's matrix interleaved on its own
        assert il[e].interleave == 8
        assert torch.equal(il[e].data, cpu.interleave(w[e]).data)
        assert torch.equal(il[e].dequantize().double(), gguf_dequant(w[e]))


def test_what_cannot_be_interleaved():
    assert not cpu.can_interleave(q4k(12, 256))  # rows not a multiple of 8
    q5 = QTensor.from_bytes(quantize(torch.randn(8, 256), QType.Q4_0), QType.Q4_0, (8, 256))  # no interleaved layout
    assert not cpu.can_interleave(q4k(12, 64, qt=QType.Q8_0))
    assert not cpu.can_interleave(q5)
    assert not cpu.can_interleave(cpu.interleave(q4k(8, 256)))  # already
    for bad in (q4k(12, 256), q5):
        with pytest.raises(ValueError):
            cpu.interleave(bad)
    with pytest.raises(ValueError):
        cpu.deinterleave(q4k(8, 256))
    with pytest.raises(ValueError):  # the layout is validated with the tensor
        QTensor(q5.data, QType.Q4_0, (8, 256), interleave=8)
    with pytest.raises(ValueError):
        QTensor(q4k(8, 256).data, Q4K, (8, 256), interleave=4)
    il = cpu.interleave(q4k(16, 256))
    with pytest.raises(ValueError):  # a row of an interleaved matrix is spread over its group
        il[0]
    with pytest.raises(ValueError):  # embedding lookups read GGUF's layout
        cpu.dequant_rows(il, torch.tensor([0]))


@QTYPES
@pytest.mark.parametrize("scratch_rows", [8, 24, 1000])
def test_read_interleaved_equals_interleave_of_the_read_bytes(tmp_path, qt, scratch_rows):
    """Read a scratch's worth of groups at a time (one group, several and a remainder, all at once), from an offset in
    a file: the same bytes as interleave() of the tensor; a file that ends early gives None, too small a scratch and an
    unreadable descriptor raise."""
    w = q4k(16, 512, seed=4, lead=(5,), qt=qt)
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 77 + w.data.numpy().tobytes())
    rb = w.data.shape[-1]
    with open(path, "rb", buffering=0) as f:
        got = cpu.read_interleaved(f.fileno(), 77, qt, w.shape, torch.empty(scratch_rows * rb, dtype=torch.uint8))
        assert got.interleave == 8 and got.shape == w.shape and torch.equal(got.data, cpu.interleave(w).data)
        assert cpu.read_interleaved(f.fileno(), 77 + rb, qt, w.shape, torch.empty(8 * rb, dtype=torch.uint8)) is None
        with pytest.raises(ValueError):
            cpu.read_interleaved(f.fileno(), 77, qt, w.shape, torch.empty(8 * rb - 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        cpu.read_interleaved(0, 0, qt, (12, 512), torch.empty(8 * rb, dtype=torch.uint8))
    with open(path, "wb") as f, pytest.raises(OSError):  # write-only: reads fail
        cpu.read_interleaved(f.fileno(), 0, qt, w.shape, torch.empty(8 * rb, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------- matmul


@pytest.fixture
def default_wide():
    yield
    cpu.set_wide()


def matmul_each_way(x: torch.Tensor, w) -> dict:
    """cpu.matmul on every kernel set, the VNNI set's one-token passes on 256-bit and on 512-bit vectors alike
    (whichever this CPU's default is), the latter with a block's prefetches at its start and spread beside its loads
    (a distance set, whatever this CPU's is): {isa, "avx512vnni wide" or "avx512vnni wide spread": y}."""
    outs = {}
    for isa in ISAS:
        for wide in ((False, True) if isa == "avx512vnni" else (False,)):
            cpu.set_wide(wide)
            outs[isa + (" wide" if wide else "")] = cpu.matmul(x, w, isa=isa)
    if "avx512vnni" in ISAS:
        cpu.set_wide(True)
        cpu.set_prefetch(512)
        for spread in (False, True):
            cpu.set_prefetch_spread(spread)
            outs["avx512vnni wide" + (" spread" if spread else " burst")] = cpu.matmul(x, w, isa="avx512vnni")
        cpu.set_prefetch()
        cpu.set_prefetch_spread()
    cpu.set_wide()
    return outs


@QTYPES
@pytest.mark.parametrize("shape", [(8, 256), (16, 768), (64, 2048), (264, 512)])
def test_matmul_matches_gguf_reference(shape, qt, default_wide):
    N, K = shape
    w = q4k(N, K, seed=N + K, qt=qt)
    il, ref_w = cpu.interleave(w), gguf_dequant(w)
    gen = torch.Generator().manual_seed(K)
    for T in (1, 2, 3, 4, 5, 8, 17, 64):
        x = torch.randn(T, K, generator=gen)
        outs = matmul_each_way(x, il)
        for isa, y in outs.items():
            assert y.shape == (T, N)
            assert rel_err(y, x.double() @ ref_w.T) < 0.02, (isa, T)
            assert rel_err(y, emulate_act(x, qt) @ ref_w.T) < 2e-5, (isa, T)
            # the GGUF-layout kernel computes the same integer sums: only float order differs
            assert rel_err(y, cpu.matmul(x, w, isa=isa.split()[0])) < 2e-6, (isa, T)
        if "avx2" in outs and "avx512vnni" in outs:
            for way in ("avx512vnni", "avx512vnni wide", "avx512vnni wide burst", "avx512vnni wide spread"):
                assert torch.equal(outs["avx2"], outs[way]), (way, T)


@QTYPES
def test_matmul_random_bytes_every_scale_pattern(qt, default_wide):
    w = q4k(32, 1024, seed=7, random_bytes=True, qt=qt)
    for T in (1, 5):  # one token: the VNNI set's 512-bit passes too (every high nibble and high-bit pattern)
        x = torch.randn(T, 1024)
        ref = emulate_act(x, qt) @ gguf_dequant(w).T
        outs = matmul_each_way(x, cpu.interleave(w))
        for isa, y in outs.items():
            assert rel_err(y, ref) < 2e-5, (isa, T)
        if "avx2" in outs and "avx512vnni" in outs:
            for way in ("avx512vnni", "avx512vnni wide", "avx512vnni wide burst", "avx512vnni wide spread"):
                assert torch.equal(outs["avx2"], outs[way]), (way, T)


@pytest.fixture
def default_prefetch():
    yield
    cpu.set_prefetch()


@QTYPES
@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_prefetch_changes_no_result(qt, T, default_prefetch):
    """The kernels' L2 prefetch for one to a few tokens (any distance, past the matrix's end too: prefetches never
    fault), and the GGUF-layout kernels' hint that follows it, leave every output bit as they are."""
    w = q4k(72, 1024, seed=3, qt=qt)
    il, ref = cpu.interleave(w), gguf_dequant(w)
    x = torch.randn(T, 1024, generator=torch.Generator().manual_seed(5))
    for isa in ISAS:
        cpu.set_prefetch(0)
        base, gguf_base = cpu.matmul(x, il, isa=isa), cpu.matmul(x, w, isa=isa)  # GGUF's layout: an L1 or L2 hint
        assert rel_err(base, emulate_act(x, qt) @ ref.T) < 2e-5, isa
        for nbytes in (64, 2048, 65536):
            cpu.set_prefetch(nbytes)
            assert cpu.features()["prefetch"] == nbytes
            assert torch.equal(cpu.matmul(x, il, isa=isa), base), (isa, nbytes)
            assert torch.equal(cpu.matmul(x, w, isa=isa), gguf_base), (isa, nbytes)


def _cpuinfo(key: str) -> str:
    """The first processor's value of `key` in /proc/cpuinfo ("model", not "model name"), or ""."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if ":" in line and line.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""


def this_cpu() -> tuple[str, int, int]:
    """(CPUID vendor, family, model) of the CPU running the test, as /proc/cpuinfo gives them."""
    return _cpuinfo("vendor_id"), int(_cpuinfo("cpu family") or 0), int(_cpuinfo("model") or 0)


# The measured defaults (pool.c's table), by (vendor, family, model): Intel family 6 model 207 T1 8 KB and the 512-bit
# one-token passes; other Intel CPUs T1 2 KB; AMD Zen 5 (family 26) NTA 4 KB and the 512-bit passes; Zen 4 and older
# none.
PREFETCH_DEFAULTS = {("GenuineIntel", 6, 207): (8192, "t1"), ("GenuineIntel", 6, 167): (2048, "t1"),
                     ("GenuineIntel", 6, 143): (2048, "t1"), ("GenuineIntel", 6, 0): (2048, "t1"),
                     ("GenuineIntel", 19, 1): (2048, "t1"), ("AuthenticAMD", 26, 2): (4096, "nta"),
                     ("AuthenticAMD", 27, 0): (4096, "nta"), ("AuthenticAMD", 25, 17): (0, "t1"),
                     ("AuthenticAMD", 25, 207): (0, "t1"), ("AuthenticAMD", 23, 49): (0, "t1"),
                     ("HygonGenuine", 24, 0): (0, "t1"), ("", 0, 0): (0, "t1")}


def expected_default(vendor: str, family: int, model: int) -> tuple[int, str]:
    if vendor == "GenuineIntel":
        return (8192, "t1") if (family, model) == (6, 207) else (2048, "t1")
    return (4096, "nta") if vendor == "AuthenticAMD" and family >= 26 else (0, "t1")


def expected_wide(vendor: str, family: int, model: int) -> list[str]:
    if vendor == "AuthenticAMD" and family >= 26:
        return ["Q4_K", "Q6_K", "MXFP4"]
    return ["Q6_K", "MXFP4"] if (vendor, family, model) == ("GenuineIntel", 6, 207) else []


def test_prefetch_defaults_per_vendor_and_family():
    """Every row of the table, whatever CPU runs the test (an Intel machine reads AMD's rows and the other way round):
    the distance and hint each vendor's measurements chose; a model left out reads as 0, no model's row."""
    for (vendor, family, model), want in PREFETCH_DEFAULTS.items():
        nbytes, hint = cpu._cpu.prefetch_default(vendor, family, model)
        assert (nbytes, cpu.PREFETCH_HINTS[hint]) == want == expected_default(vendor, family, model), (vendor, family)
    assert cpu._cpu.prefetch_default("GenuineIntel", 6) == (2048, cpu.PREFETCH_HINTS.index("t1"))


def test_wide_passes_default_per_vendor_and_family(default_wide):
    """The table's 512-bit one-token passes, by row type: all three where they were measured faster (AMD Zen 5), Q6_K
    and MXFP4 on Intel family 6 model 207 (Q4_K streamed faster on 256-bit vectors there), none on other Intel models
    and older AMD until measured there; every row whatever CPU runs the test, and this CPU's default. set_wide takes
    True, False or names of those types, anything else is a ValueError."""
    for vendor, family, model in PREFETCH_DEFAULTS:
        mask = cpu._cpu.wide_default(vendor, family, model)
        assert cpu.wide_types(mask) == expected_wide(vendor, family, model), (vendor, family)
    for bad in (1, "yes", 0.0, ["Q5_K"], ["Q4_K", 6], {"q4_k": True}):
        with pytest.raises(ValueError, match="wide"):
            cpu.set_wide(bad)
    for on, want in ((True, ["Q4_K", "Q6_K", "MXFP4"]), (False, []), ("q6_k", ["Q6_K"]),
                     (["MXFP4", "Q4_K", "q4_k"], ["Q4_K", "MXFP4"])):
        cpu.set_wide(on)
        assert cpu.features()["wide"] == want, on
    cpu.set_wide()
    assert cpu.features()["wide"] == expected_wide(*this_cpu())


def expected_spread(vendor: str, family: int, model: int) -> bool:
    return (vendor, family, model) == ("GenuineIntel", 6, 207)


def test_prefetch_spread_default_per_vendor_and_family():
    """The table's prefetch placement in the 512-bit passes: a block's lines beside their loads where that was measured
    faster (Intel family 6 model 207), all at the block's start elsewhere until measured there (AMD Zen 5's 512-bit
    passes included); every row whatever CPU runs the test, and this CPU's default."""
    for vendor, family, model in PREFETCH_DEFAULTS:
        assert cpu._cpu.prefetch_spread_default(vendor, family, model) is expected_spread(vendor, family, model)
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match="prefetch spread"):
            cpu.set_prefetch_spread(bad)
    try:
        cpu.set_prefetch_spread(not expected_spread(*this_cpu()))
        assert cpu.features()["prefetch_spread"] is not expected_spread(*this_cpu())
    finally:
        cpu.set_prefetch_spread()
    assert cpu.features()["prefetch_spread"] is expected_spread(*this_cpu())


def test_set_prefetch_checks_its_distance(default_prefetch):
    for bad in (-64, 100, 65600, 1.5, True):
        with pytest.raises(ValueError, match="multiple of 64"):
            cpu.set_prefetch(bad)
    cpu.set_prefetch(0)
    assert cpu.features()["prefetch"] == 0
    cpu.set_prefetch()  # this CPU's default, from the table
    cpu.set_prefetch_hint()
    assert (cpu.features()["prefetch"], cpu.features()["prefetch_hint"]) == expected_default(*this_cpu())


# ------------------------------------------------------------------------------------------ moe_ffn


def reference_moe(x, ids, wts, gate, up, down) -> torch.Tensor:
    """float64 MoE over gguf.quants-dequantized experts."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        xe = x[tok].double()
        h = F.silu(xe @ gguf_dequant(gate[e]).T) * (xe @ gguf_dequant(up[e]).T)
        out.index_add_(0, tok, (h @ gguf_dequant(down[e]).T) * wts[tok, slot, None].double())
    return out


@QTYPES
@pytest.mark.parametrize("T", [1, 3, 33])
def test_moe_ffn_over_interleaved_experts(T, qt):
    E, H, I, k = 6, 512, 256, 3
    gate, up = q4k(I, H, seed=1, lead=(E,), qt=qt), q4k(I, H, seed=2, lead=(E,), qt=qt)
    down = q4k(H, I, seed=3, lead=(E,), qt=qt)
    gen = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=gen), -1)
    x = torch.randn(T, H, generator=gen)
    ref = reference_moe(x, ids, wts, gate, up, down)
    plain = cpu.moe_ffn(x, ids, wts, gate, up, down)
    ig, iu, idn = cpu.interleave(gate), cpu.interleave(up), cpu.interleave(down)
    for mats in ((ig, iu, idn), (ig, up, down), (gate, iu, idn)):  # all, or some kinds interleaved
        ys = {isa: cpu.moe_ffn(x, ids, wts, *mats, isa=isa) for isa in ISAS}
        for isa, y in ys.items():
            assert rel_err(y, ref) < 0.03, isa
            assert rel_err(y, plain) < 1e-3, isa  # float order can flip one rounding of h
        if "avx2" in ys and "avx512vnni" in ys:  # 16-row kernels (VNNI, batches) equal two 8-row calls exactly
            assert torch.equal(ys["avx2"], ys["avx512vnni"])
    # per-expert buffers (an expert cache's slots) laid out the same way
    routed = {e: Expert(ig[e], iu[e], idn[e]) for e in torch.unique(ids).tolist()}
    assert torch.equal(cpu.moe_ffn_experts(x, ids, wts, routed), cpu.moe_ffn(x, ids, wts, ig, iu, idn))
    mixed = dict(routed)
    e0 = next(iter(mixed))
    mixed[e0] = Expert(gate[e0], iu[e0], idn[e0])
    if len(mixed) > 1:
        with pytest.raises(ValueError, match="laid out like"):
            cpu.moe_ffn_experts(x, ids, wts, {e: mixed[e] for e in sorted(mixed, reverse=True)})


# -------------------------------------------------------------------------------------------- model


def test_loaded_model_interleaves_owned_q4_k_and_keeps_its_logits(wide_q4k_gguf, tokens32):
    from moerun.loading import load_model

    plain = load_model(wide_q4k_gguf, interleave=False).model
    fast = load_model(wide_q4k_gguf).model
    lw = fast.layers[0]
    assert lw.wq.interleave == 8 and plain.layers[0].wq.interleave == 1
    assert fast.embd.interleave == 1  # looked up by row
    ex = fast.store.get(0, 0)
    assert ex.gate.interleave == 8  # a small model's experts are copied to RAM, so they are interleaved too
    a, b = plain.forward(tokens32), fast.forward(tokens32)
    assert rel_err(b, a) < 1e-4  # same integer sums, other float order
    mapped = load_model(wide_q4k_gguf, home="mmap").model
    assert mapped.store.get(0, 0).gate.interleave == 1  # experts in the file's map are read as stored
    assert mapped.layers[0].wq.interleave == 8
    assert rel_err(mapped.forward(tokens32), a) < 1e-4


def test_expert_cache_over_interleaved_home_equals_resident(wide_q4k_gguf, tokens32):
    """Cache slots copy an owned expert's bytes as they are: a one-slot cache gives the resident logits."""
    from moerun.experts.cache import ExpertCache
    from moerun.loading import load_model
    from moerun.model.moe import CachedExperts

    model = load_model(wide_q4k_gguf, home="ram").model
    resident = model.forward(tokens32)
    model.experts = CachedExperts(ExpertCache(model.store, slots=1))
    assert torch.equal(model.forward(tokens32), resident)


@pytest.fixture(scope="module")
def wide_q4k_gguf(tmp_path_factory):
    """A Q4_K qwen3moe whose matrices have rows that are multiples of 8 (hidden 256, expert FFN 256)."""
    from hf_models import build, hf_config, save

    from moerun.tools.convert import convert_hf_to_gguf

    cfg = hf_config("qwen3moe")
    cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim = 256, 256, 64
    folder = save(build("qwen3moe", config=cfg), tmp_path_factory.mktemp("wide"))
    return convert_hf_to_gguf(folder, tmp_path_factory.mktemp("gguf") / "m.gguf", ftype="Q4_K", progress=False)
