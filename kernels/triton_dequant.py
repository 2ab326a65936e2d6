"""Triton helpers that dequantize GGUF blocks in registers (imported by triton_q only when kernels run).

`dq_tile(w_ptr, row_off, rmask, k0, K, kv_ptr, QTYPE, BK)` returns elements k0 .. k0 + BK of the rows
that start at byte offsets `row_off` ([BN] int64) as float32 [BN, BK]. The tile is worked on as
[BN, sub-blocks, SUB] (SUB = 32, 16 for Q6_K, the scale granularity): scales and block headers are read
once per sub-block, quant bits once per element, and the result is reshaped to [BN, BK]. k0 and BK are
multiples of 32; K need only be a whole number of blocks (sub-blocks past K and rows where rmask is
False are not read, and give 0). The arithmetic follows moerun.quant.dequant step by step (f16 scales
widened first, the same products in the same order), so without fused multiply-adds (the interpreter)
the values are bit-exact with the torch reference.
`kv_ptr` points at the 16-entry float32 code book of IQ4_XS / MXFP4 (unused by the other types).

Importing this module decorates the kernels, and triton reads TRITON_INTERPRET at that moment.
"""

from __future__ import annotations

import triton
import triton.language as tl

Q4_0 = tl.constexpr(2)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)
IQ4_XS = tl.constexpr(23)
MXFP4 = tl.constexpr(39)

INTERPRETED = bool(triton.knobs.runtime.interpret)  # how this module's kernels were built


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian f16 at p, widened to f32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(p, shift, mask):
    return (_byte(p, mask) >> shift) & 15


@triton.jit
def _scale_min_k4(blk, s, mask):
    """Q4_K/Q5_K 6-bit scale and min of sub-block s (0..7) from the 12 bytes at blk + 4."""
    i = s & 3
    a = _byte(blk + 4 + i, mask)
    b = _byte(blk + 8 + i, mask)
    c = _byte(blk + 12 + i, mask)
    lo = s < 4
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 2) & 48))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q8_0(row, s, i, mask):
    blk = row + s * 34  # [BN, NS, 1]
    q = tl.load(blk + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)  # [BN, NS, 32]
    return q.to(tl.float32) * _f16(blk, mask)


@triton.jit
def _q4_0(row, s, i, mask):
    blk = row + s * 18
    q = _nibble(blk + 2 + i % 16, (i // 16) * 4, mask) - 8
    return _f16(blk, mask) * q.to(tl.float32)


@triton.jit
def _q4_k(row, s, i, mask):
    blk = row + (s // 8) * 144
    sub = s % 8
    sc, mn = _scale_min_k4(blk, sub, mask)
    dl = _f16(blk, mask) * sc
    ml = _f16(blk + 2, mask) * mn
    q = _nibble(blk + 16 + (sub // 2) * 32 + i, (sub % 2) * 4, mask)
    return q.to(tl.float32) * dl - ml


@triton.jit
def _q5_k(row, s, i, mask):
    blk = row + (s // 8) * 176
    sub = s % 8
    sc, mn = _scale_min_k4(blk, sub, mask)
    dl = _f16(blk, mask) * sc
    ml = _f16(blk + 2, mask) * mn
    lo = _nibble(blk + 48 + (sub // 2) * 32 + i, (sub % 2) * 4, mask)
    hi = (_byte(blk + 16 + i, mask) >> sub) & 1
    return (lo | (hi << 4)).to(tl.float32) * dl - ml


@triton.jit
def _q6_k(row, s, i, mask):
    """Sub-blocks of 16 (one int8 scale each); j is the element within the 256-block."""
    blk = row + (s // 16) * 210
    j = (s % 16) * 16 + i  # [1, NS, 16]
    half = j // 128
    lo = _nibble(blk + half * 64 + j % 64, ((j % 128) // 64) * 4, mask)
    hi = (_byte(blk + 128 + half * 32 + j % 32, mask) >> (((j % 128) // 32) * 2)) & 3
    sc = tl.load(blk + 192 + s % 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    dl = _f16(blk + 208, mask) * sc
    return dl * ((lo | (hi << 4)) - 32).to(tl.float32)


@triton.jit
def _iq4_xs(row, s, i, mask, kv_ptr):
    blk = row + (s // 8) * 136
    sub = s % 8
    sl = _nibble(blk + 4 + sub // 2, (sub % 2) * 4, mask)
    sh = (_byte(blk + 2 + sub // 4, mask) >> ((sub % 4) * 2)) & 3
    dl = _f16(blk, mask) * ((sl | (sh << 4)) - 32).to(tl.float32)
    q = _nibble(blk + 8 + sub * 16 + i % 16, (i // 16) * 4, mask)
    return dl * tl.load(kv_ptr + q)


@triton.jit
def _mxfp4(row, s, i, mask, kv_ptr):
    blk = row + s * 17
    e = _byte(blk, mask)
    subnormal = tl.full(e.shape, 0x00200000, tl.int32) << e
    d = tl.where(e < 2, subnormal, (e - 1) << 23).to(tl.float32, bitcast=True)  # 2**(e - 128)
    q = _nibble(blk + 1 + i % 16, (i // 16) * 4, mask)
    return d * tl.load(kv_ptr + q)


@triton.jit
def _subblocks(k0, K, rmask, NS: tl.constexpr, SUB: tl.constexpr):
    """Sub-block index in the row s [1, NS, 1], element index in it i [1, 1, SUB], mask [BN, NS, 1]."""
    s = k0 // SUB + tl.arange(0, NS)[None, :, None]
    i = tl.arange(0, SUB)[None, None, :]
    return s, i, rmask[:, None, None] & (s * SUB < K)


@triton.jit
def dq_tile(w_ptr, row_off, rmask, k0, K, kv_ptr, QTYPE: tl.constexpr, BK: tl.constexpr):
    """[BN, BK] float32 weights; row_off [BN] int64 bytes, rmask [BN]."""
    row = w_ptr + row_off[:, None, None]  # [BN, 1, 1]
    if QTYPE == Q6_K:
        s, i, mask = _subblocks(k0, K, rmask, BK // 16, 16)
        w = _q6_k(row, s, i, mask)
    else:
        s, i, mask = _subblocks(k0, K, rmask, BK // 32, 32)
        if QTYPE == Q8_0:
            w = _q8_0(row, s, i, mask)
        elif QTYPE == Q4_0:
            w = _q4_0(row, s, i, mask)
        elif QTYPE == Q4_K:
            w = _q4_k(row, s, i, mask)
        elif QTYPE == Q5_K:
            w = _q5_k(row, s, i, mask)
        elif QTYPE == IQ4_XS:
            w = _iq4_xs(row, s, i, mask, kv_ptr)
        else:
            tl.static_assert(QTYPE == MXFP4, "unsupported qtype")
            w = _mxfp4(row, s, i, mask, kv_ptr)
    return tl.reshape(w, (row_off.shape[0], BK))


@triton.jit
def dequantize_kernel(w_ptr, out_ptr, kv_ptr, N, K, row_bytes,
                      QTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out [N, K] float32 = the weights of w [N, K]; grid (cdiv(N, BN), cdiv(K, BK))."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    k0 = tl.program_id(1) * BK
    w = dq_tile(w_ptr, rows.to(tl.int64) * row_bytes, rows < N, k0, K, kv_ptr, QTYPE, BK)  # [BN, BK]
    k = k0 + tl.arange(0, BK)[None, :]  # [1, BK]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + k, w, mask=(rows[:, None] < N) & (k < K))
