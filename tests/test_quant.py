"""moerun.quant.dequant / quantize against gguf.quants (the independent numpy reference)."""

from __future__ import annotations

import warnings

import gguf.quants as gq
import numpy as np
import pytest
import torch

from moerun.quant.dequant import dequantize
from moerun.quant.qtypes import SUPPORTED, QType, block_size
from moerun.quant.quantize import quantize

BLOCK_TYPES = sorted(SUPPORTED - {QType.F32, QType.F16, QType.BF16})
FLOAT_TYPES = [QType.F32, QType.F16, QType.BF16]

# Byte offsets of the f16 scale fields (d, dmin, m) inside one block of each type.
F16_FIELDS = {
    QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q8_0: (0,),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
    QType.IQ4_NL: (0,), QType.IQ4_XS: (0,), QType.MXFP4: (),
}

# Finite f16 scales worth hitting: zeros, the smallest subnormal, the smallest normal, negatives,
# the largest finite, values whose products round.
EDGE_SCALES = np.array(
    [0.0, -0.0, 6e-8, -6e-8, 6.1035e-5, 1e-3, -1e-3, 0.1, -0.3, 1.0, -1.0, 2.5, 1e4, -3e4, 65504.0, -65504.0],
    dtype=np.float16,
)


def ref_dequant(raw: np.ndarray, qtype: QType) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return gq.dequantize(raw, qtype)


def bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32).reshape(-1)


def assert_bit_exact(got: torch.Tensor, ref: np.ndarray):
    assert got.dtype == torch.float32
    g, r = bits(got), bits(ref)
    bad = np.flatnonzero(g != r)
    assert bad.size == 0, f"{bad.size} mismatches, first at {bad[0]}: {g[bad[0]]:#x} != {r[bad[0]]:#x}"


def random_blocks(qtype: QType, nb: int, seed: int) -> np.ndarray:
    """[nb, block_bytes]: random payload bytes, finite f16 scale fields (half from EDGE_SCALES),
    MXFP4 exponents cycling through all 256 values, and the last 4 blocks all zero."""
    rng = np.random.default_rng(seed)
    _, nbytes = block_size(qtype)
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        finite = rng.standard_normal(nb).astype(np.float16) * np.float16(4.0) ** rng.integers(-6, 6, nb)
        edge = rng.choice(EDGE_SCALES, nb)
        scale = np.where(rng.random(nb) < 0.5, edge, finite).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(nb, 2)
    if qtype == QType.MXFP4:
        raw[:, 0] = np.arange(nb) % 256
    raw[-4:] = 0
    return raw


def tensor_shapes(qtype: QType) -> list[tuple[int, ...]]:
    n = block_size(qtype)[0]
    return [(5, 3 * n), (3, 4, 2 * n), (n,)]


# ------------------------------------------------------------------------------------ dequantize


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_dequant_block_types_bit_exact(qtype):
    elems, nbytes = block_size(qtype)
    for i, shape in enumerate(tensor_shapes(qtype)):
        numel = int(np.prod(shape))
        raw = random_blocks(qtype, numel // elems, seed=i)
        raw = raw.reshape(*shape[:-1], shape[-1] // elems * nbytes)  # [*rows, row_bytes] as stored
        ref = ref_dequant(raw, qtype)
        assert ref.shape == shape
        data = torch.from_numpy(raw)
        before = data.clone()
        got = dequantize(data, qtype, shape)
        assert tuple(got.shape) == shape
        assert_bit_exact(got, ref)
        assert torch.equal(data, before)  # the input is never written
        assert_bit_exact(dequantize(data.reshape(-1), qtype, shape), ref)  # flat bytes work too


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_dequant_fully_random_bytes(qtype):
    """Random scale bytes too (infinities, NaNs): equal bits, except that when two NaNs meet in one
    operation the hardware picks either payload, so NaN positions need only agree."""
    elems, nbytes = block_size(qtype)
    raw = np.random.default_rng(7).integers(0, 256, size=(512, nbytes), dtype=np.uint8)
    ref = ref_dequant(raw, qtype).reshape(-1)
    got = dequantize(torch.from_numpy(raw), qtype, (512 * elems,)).numpy()
    nan = np.isnan(ref)
    assert np.array_equal(nan, np.isnan(got))
    assert np.array_equal(bits(got)[~nan], bits(ref)[~nan])


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_dequant_chunked_large(qtype, monkeypatch):
    """More blocks than one chunk, and a chunk size that does not divide the block count."""
    import moerun.quant.dequant as dq

    elems, _ = block_size(qtype)
    monkeypatch.setattr(dq, "CHUNK_ELEMS", 7 * 256)
    raw = random_blocks(qtype, 300, seed=3)
    assert_bit_exact(dequantize(torch.from_numpy(raw), qtype, (300, elems)), ref_dequant(raw, qtype))


def test_mxfp4_every_exponent_and_code():
    # E8M0 bytes 0..255 (0 and 1 give f32 subnormals, 255 gives 2**127 and so infinities for |code| > 2)
    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    codes = np.arange(16, dtype=np.uint8)
    raw[:, 1:17] = codes | ((15 - codes) << 4)  # every E2M1 code in both nibble positions
    ref = ref_dequant(raw, QType.MXFP4)
    assert np.isinf(ref).any() and (ref[:2] != 0).any()
    assert_bit_exact(dequantize(torch.from_numpy(raw), QType.MXFP4, (256, 32)), ref)


@pytest.mark.parametrize("qtype", [*BLOCK_TYPES, *FLOAT_TYPES], ids=lambda q: q.name)
def test_dequant_from_read_only_memory_map(qtype, tmp_path):
    """A write to a read-only mapping would crash the test process."""
    elems, nbytes = block_size(qtype)
    raw = random_blocks(qtype, 64, seed=5) if qtype in F16_FIELDS else np.arange(64 * nbytes, dtype=np.uint8)
    path = tmp_path / "t.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the array is not writable
        data = torch.from_numpy(mm)
    got = dequantize(data, qtype, (4, 16 * elems))
    assert_bit_exact(got, ref_dequant(raw.reshape(4, -1), qtype).reshape(4, -1))


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda q: q.name)
def test_dequant_float_types_bit_exact(qtype):
    """All bit patterns, NaN payloads (signalling ones included) and infinities as well."""
    rng = np.random.default_rng(11)
    width = {QType.F32: 4, QType.F16: 2, QType.BF16: 2}[qtype]
    raw = rng.integers(0, 256, size=(3, 4, 64 * width), dtype=np.uint8)
    if width == 2:  # every 16-bit pattern once
        raw = np.concatenate([raw.reshape(-1), np.arange(65536, dtype=np.uint16).view(np.uint8)])
    shape = (raw.size // width,) if raw.ndim == 1 else (3, 4, 64)
    if qtype == QType.BF16:
        ref = ref_dequant(raw.reshape(-1, 2), qtype).reshape(shape)  # gguf views BF16 as bytes pairs
    else:
        ref = ref_dequant(raw.view({4: np.float32, 2: np.float16}[width]), qtype).reshape(shape)
    data = torch.from_numpy(raw)
    got = dequantize(data, qtype, shape)
    assert tuple(got.shape) == shape
    assert_bit_exact(got, ref)
    got[...] = 1.0  # the result owns its memory (F32 is not a view of the input)
    assert np.array_equal(data.numpy(), raw)
    # bytes at an odd offset cannot be viewed in place: still correct
    odd = torch.from_numpy(np.concatenate([np.zeros(1, np.uint8), raw.reshape(-1)]))[1:]
    assert_bit_exact(dequantize(odd, qtype, shape), ref)


def test_dequant_rejects_bad_input():
    with pytest.raises(ValueError, match="TQ1_0"):
        dequantize(torch.zeros(54, dtype=torch.uint8), QType.TQ1_0, (256,))
    with pytest.raises(ValueError):
        dequantize(torch.zeros(17, dtype=torch.uint8), QType.Q4_0, (32,))  # one byte short
    with pytest.raises(ValueError):
        dequantize(torch.zeros(18, dtype=torch.uint8), QType.Q4_0, (2, 16))  # row not whole blocks
    with pytest.raises(ValueError):
        dequantize(torch.zeros(9, dtype=torch.int16), QType.Q4_0, (32,))


# -------------------------------------------------------------------------------------- quantize


def gaussian(shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def edge_rows(n: int) -> torch.Tensor:
    """Rows exercising rounding edges: zeros, a constant, exact halves (ties), one outlier, tiny,
    mixed-sign extremes of equal magnitude (argmax tie), all-positive, all-negative."""
    ar = torch.arange(n, dtype=torch.float32)
    rows = [
        torch.zeros(n),
        torch.full((n,), 0.75),
        (ar % 32 - 15.5) * 0.5,  # halves: x / d lands on .5 ties
        torch.where(ar % 32 == 0, 127.0, (ar % 32) - 16.5),  # exact Q8_0 ties with d = 1
        torch.where(ar % 32 == 3, 100.0, 0.01 * torch.sin(ar)),
        1e-6 * torch.cos(ar),
        torch.where(ar % 2 == 0, 8.0, -8.0),
        2.0 + torch.sin(ar) ** 2,
        -3.0 - torch.cos(ar) ** 2,
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, *FLOAT_TYPES], ids=lambda q: q.name)
def test_quantize_matches_gguf_bytes(qtype):
    x = torch.cat([gaussian((6, 256)) * 3, edge_rows(256)]).reshape(5, 3, 256)  # 3-D [E, rows, cols]
    got = quantize(x, qtype)
    ref = gq.quantize(x.numpy(), qtype)
    ref = np.ascontiguousarray(ref).view(np.uint8).reshape(got.shape)
    assert got.dtype == torch.uint8
    assert tuple(got.shape) == (5, 3, ref.shape[-1])
    assert np.array_equal(got.numpy(), ref)


def test_quantize_float_nan_and_inf_bytes_match():
    pats = np.random.default_rng(5).integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([pats, [0x7F800001, 0xFFC12345, 0x7F800000, 0x477FF000, 1]]).astype(np.uint32)
    x = x.view(np.float32)
    for qtype in FLOAT_TYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ref = np.ascontiguousarray(gq.quantize(x, qtype)).view(np.uint8)
        assert np.array_equal(quantize(torch.from_numpy(x.copy()), qtype).numpy(), ref), qtype.name


def roundtrip(x: torch.Tensor, qtype: QType) -> torch.Tensor:
    """quantize with moerun, dequantize with gguf.quants."""
    return torch.from_numpy(ref_dequant(quantize(x, qtype).numpy(), qtype)).reshape(x.shape)


def test_q8_0_roundtrip_error_bound():
    # |x - q*d16| <= d/2 (rounding, |x/d| <= 127) + 127*|d - d16| (the f16 scale). In f16's normal
    # range |d - d16| <= d * 2**-11; for tiny blocks (d below 6e-5) the f16 scale loses precision.
    x = torch.cat([gaussian((8, 512)), edge_rows(512)])
    err = (roundtrip(x, QType.Q8_0) - x).abs().view(-1, 32)
    d = x.view(-1, 32).abs().amax(-1, keepdim=True) / 127
    d16 = d.half().float()
    assert (err <= (d / 2 + 127 * (d - d16).abs()) * (1 + 1e-6)).all()
    normal = d >= 2**-14
    assert normal.sum() > 200
    assert (err <= d * (0.5 + 127 * 2**-11) * (1 + 1e-6))[normal.view(-1)].all()
    assert roundtrip(torch.zeros(1, 64), QType.Q8_0).eq(0).all()


def test_q4_0_roundtrip_error_bound():
    # d = -max/8 (max: the signed extreme); t = x/d lies in [-8, 8]. Levels are q - 8 in [-8, 7]:
    # |err| <= |d|/2 where t < 7.5 and (t - 7)*|d| <= |d| where t is clamped to 7; plus 8*|d - d16|
    # (<= 8*|d|*2**-11 in f16's normal range).
    x = torch.cat([gaussian((8, 512)), edge_rows(512)]).view(-1, 32)
    err = (roundtrip(x, QType.Q4_0) - x).abs()
    ext = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    d = (ext / -8).abs()
    t = torch.where(d > 0, x / (ext / -8), 0.0)
    d16 = (ext / -8).half().float().abs()
    allowed = torch.where(t < 7.5, 0.5, t - 7) * d + 8 * (d - d16).abs()
    assert (err <= allowed * (1 + 1e-5)).all()
    normal = (d >= 2**-14).view(-1)
    assert (err <= d * (1 + 8 * 2**-11) * (1 + 1e-6))[normal].all()


def rel_rms(err: torch.Tensor, x: torch.Tensor) -> float:
    return (err.square().mean() / x.square().mean()).sqrt().item()


def test_q4_k_roundtrip_accuracy():
    # Measured relative RMS error on N(0, 1): 0.0714 (0.0784 with plain min/max and no refits).
    x = gaussian((3, 16, 512), seed=1)  # 3-D [E, rows, cols]
    q = quantize(x, QType.Q4_K)
    assert tuple(q.shape) == (3, 16, 512 // 256 * 144)
    y = roundtrip(x, QType.Q4_K)
    assert rel_rms(y - x, x) < 0.075
    # max error per 32-weight sub-block within 1.2 steps of its min/max grid (measured: 0.91)
    xs, ys = x.reshape(-1, 32), y.reshape(-1, 32)
    step = (xs.amax(-1) - xs.amin(-1).clamp(max=0)) / 15
    assert ((ys - xs).abs().amax(-1) <= step * 1.2 + 1e-6).all()
    # our dequantizer agrees bit for bit with gguf's on our bytes
    assert_bit_exact(dequantize(q, QType.Q4_K, tuple(x.shape)), y.numpy())


# Relative RMS error per edge row, measured: Q4_K 0, 0.0002, 0.054, 0.106, 0.0023, 1.0, 0.0004, 0.021,
# 0.0061; Q6_K 0, 0, 0.014, 0.032, 0.0004, 1.0, 0.022, 0.011, 0.009. Row 2 (32 evenly spaced values
# in 16 levels) cannot do better than 0.056; row 3 is dominated by its outlier; row 5 (|x| ~ 1e-6)
# flushes to zero because the f16 super-block scale underflows, as in llama.cpp.
EDGE_ROW_BOUNDS = {QType.Q4_K: [0, 0.01, 0.06, 0.12, 0.01, 1.0, 0.01, 0.03, 0.01],
                   QType.Q6_K: [0, 0.01, 0.02, 0.04, 0.01, 1.0, 0.03, 0.015, 0.015]}


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_k_quant_edge_rows(qtype):
    x = edge_rows(256)
    y = roundtrip(x, qtype)
    assert y.isfinite().all()
    assert y[0].eq(0).all()  # zeros stay zeros
    for i, bound in enumerate(EDGE_ROW_BOUNDS[qtype][1:], start=1):
        assert rel_rms(y[i] - x[i], x[i]) <= bound * 1.05, i
    assert_bit_exact(dequantize(quantize(x, qtype), qtype, tuple(x.shape)), y.numpy())


def test_q4_k_offset_data():
    # All-positive sub-blocks: the min is clamped to 0 (as llama.cpp does), so the step is max/15.
    # Measured relative RMS 0.023 on N(5, 1).
    z = gaussian((4, 256), seed=2) + 5.0
    assert rel_rms(roundtrip(z, QType.Q4_K) - z, z) < 0.026


def test_q6_k_roundtrip_accuracy():
    # Measured relative RMS error on N(0, 1): 0.0186 (per-16 absmax scales, int8 with f16 d).
    x = gaussian((3, 16, 512), seed=4)
    q = quantize(x, QType.Q6_K)
    assert tuple(q.shape) == (3, 16, 512 // 256 * 210)
    y = roundtrip(x, QType.Q6_K)
    assert rel_rms(y - x, x) < 0.02
    # max error per 16 weights within 1.25 steps of absmax/32 (measured 1.07: the +32 side clamps at
    # 31, and the int8 scale is rounded)
    xs, ys = x.reshape(-1, 16), y.reshape(-1, 16)
    assert ((ys - xs).abs().amax(-1) <= xs.abs().amax(-1) / 32 * 1.25).all()
    assert_bit_exact(dequantize(q, QType.Q6_K, tuple(x.shape)), y.numpy())


def test_quantize_chunking_and_dtypes(monkeypatch):
    import moerun.quant.quantize as qz

    x = gaussian((6, 512), seed=9)
    whole = {qt: quantize(x, qt) for qt in (QType.Q4_K, QType.Q6_K, QType.Q8_0)}
    monkeypatch.setattr(qz, "CHUNK_ELEMS", 3 * 256)  # several chunks, last one partial
    for qt, ref in whole.items():
        assert torch.equal(quantize(x, qt), ref)
    # non-contiguous and half-precision inputs
    assert torch.equal(quantize(x.t().contiguous().t(), QType.Q8_0), whole[QType.Q8_0])
    xb = x.to(torch.bfloat16)
    assert torch.equal(quantize(xb, QType.Q4_K), quantize(xb.float(), QType.Q4_K))


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="Q5_K"):
        quantize(torch.zeros(256), QType.Q5_K)
    with pytest.raises(ValueError):
        quantize(torch.zeros(4, 48), QType.Q8_0)
    with pytest.raises(ValueError):
        quantize(torch.zeros(4, 128), QType.Q4_K)
    with pytest.raises(ValueError):
        quantize(torch.zeros(32, dtype=torch.int32), QType.Q8_0)


def test_block_dequantizers_run_on_the_device_of_their_input():
    """A GPU stage dequantizes embedding rows on the GPU: no block function may mix in a host tensor. The meta
    device has no data but raises on a device mix, as CUDA would."""
    from moerun.quant.dequant import block_dequantizers, dequantize
    from moerun.quant.qtypes import block_size

    for qt in block_dequantizers():
        elems, nbytes = block_size(qt)
        out = dequantize(torch.zeros(4 * nbytes, dtype=torch.uint8, device="meta"), qt, (2, 2 * elems))
        assert out.device.type == "meta" and out.shape == (2, 2 * elems), qt.name
