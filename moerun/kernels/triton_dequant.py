"""Triton helpers that dequantize GGUF blocks in registers (imported by triton_q only when kernels run).

`dq_tile(w_ptr, row_off, rmask, k0, K, kv_ptr, QTYPE, BK, SP, ALIGNED)` returns elements k0 .. k0 + BK of
the rows that start at byte offsets `row_off` ([BN] int64) as float32 [BN, BK]. BK is a whole number of
blocks and k0 a multiple of BK; K need only be a whole number of blocks (elements past K, and rows where
rmask is False, give 0).

How the bytes are read. GGUF blocks are 34 (Q8_0), 18 (Q4_0), 17 (MXFP4), 210 (Q6_K) or 136 (IQ4_XS)
bytes: a block's fields are not 16-byte aligned, and loading them where they lie gives byte loads. So
each row's tile is read as one span: the bytes of its BK // QK blocks, from the 16-byte boundary at or
before the first one, SP bytes wide (SP = pow2(15 + bytes of the blocks)), in 16-byte vectors (with
ALIGNED, the host's promise that w_ptr is 16-byte aligned: the mask then ends at a 16-byte boundary,
never past a chunk holding a byte of the tile). Fields are taken from the span in registers
(tl.gather: shuffles or shared memory), each scale once per sub-block, each quant once per element.

The arithmetic follows moerun.quant.dequant step by step (f16 scales widened first, the same products in
the same order), so without fused multiply-adds (the interpreter) the values are bit-exact with the torch
reference. `kv_ptr` points at the 16-entry float32 code book of IQ4_XS / MXFP4 (unused otherwise).

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
def _g(span, idx):
    """span [BN, SP] uint8 at idx [BN, X] -> int32 [BN, X]."""
    return tl.gather(span, idx, 1).to(tl.int32)


@triton.jit
def _f16(span, idx):
    """The little-endian f16 at idx [BN, X], widened to f32."""
    lo = tl.gather(span, idx, 1).to(tl.uint16)
    hi = tl.gather(span, idx + 1, 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min_k4(span, blk, sub):
    """Q4_K/Q5_K 6-bit scale and min of sub-block sub (0..7) from the 12 bytes at blk + 4; [BN, NS]."""
    i = sub & 3
    a = _g(span, blk + 4 + i)
    b = _g(span, blk + 8 + i)
    c = _g(span, blk + 12 + i)
    lo = sub < 4
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 2) & 48))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _code(kv_ptr, q, BN: tl.constexpr):
    """The code book's entries q [BN, X] (0..15), looked up in registers: the 16 floats are loaded once."""
    kv = tl.broadcast_to(tl.load(kv_ptr + tl.arange(0, 16))[None, :], (BN, 16))
    return tl.gather(kv, q, 1)


@triton.jit
def _sub3(x, BN: tl.constexpr, NS: tl.constexpr, SUB: tl.constexpr):
    """[BN, NS * SUB] -> [BN, NS, SUB]."""
    return tl.reshape(x, (BN, NS, SUB))


@triton.jit
def _decode(span, off, kv_ptr, QTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The tile's weights [BN, NS, SUB] from its span; off [BN, 1]: the first block's byte in the span."""
    if QTYPE == Q6_K:
        NS: tl.constexpr = BK // 16
        e = tl.arange(0, BK)[None, :]  # [1, BK] element in the tile
        t = tl.arange(0, NS)[None, :]  # [1, NS] sub-block in the tile
        blk = off + (e // 256) * 210  # [BN, BK]
        j = e % 256
        half = j // 128
        lo = (_g(span, blk + half * 64 + j % 64) >> (((j % 128) // 64) * 4)) & 15
        hi = (_g(span, blk + 128 + half * 32 + j % 32) >> (((j % 128) // 32) * 2)) & 3
        sblk = off + (t // 16) * 210  # [BN, NS]
        sc = tl.gather(span, sblk + 192 + t % 16, 1).to(tl.int8, bitcast=True).to(tl.float32)
        dl = _f16(span, sblk + 208) * sc
        w = dl[:, :, None] * _sub3(((lo | (hi << 4)) - 32).to(tl.float32), BN, NS, 16)
    else:
        NS: tl.constexpr = BK // 32
        e = tl.arange(0, BK)[None, :]
        t = tl.arange(0, NS)[None, :]
        i = e % 32
        if QTYPE == Q8_0:
            q = tl.gather(span, off + (e // 32) * 34 + 2 + i, 1).to(tl.int8, bitcast=True)
            w = _sub3(q.to(tl.float32), BN, NS, 32) * _f16(span, off + t * 34)[:, :, None]
        elif QTYPE == Q4_0:
            q = (_g(span, off + (e // 32) * 18 + 2 + i % 16) >> ((i // 16) * 4)) & 15
            w = _f16(span, off + t * 18)[:, :, None] * _sub3((q - 8).to(tl.float32), BN, NS, 32)
        elif QTYPE == Q4_K or QTYPE == Q5_K:
            BB: tl.constexpr = 144 if QTYPE == Q4_K else 176
            sub = (e // 32) % 8
            blk = off + (e // 256) * BB
            if QTYPE == Q4_K:
                q = (_g(span, blk + 16 + (sub // 2) * 32 + i) >> ((sub % 2) * 4)) & 15
            else:
                q = (_g(span, blk + 48 + (sub // 2) * 32 + i) >> ((sub % 2) * 4)) & 15
                q = q | (((_g(span, blk + 16 + i) >> sub) & 1) << 4)
            sblk = off + (t // 8) * BB
            sc, mn = _scale_min_k4(span, sblk, t % 8)
            dl = _f16(span, sblk) * sc
            ml = _f16(span, sblk + 2) * mn
            w = _sub3(q.to(tl.float32), BN, NS, 32) * dl[:, :, None] - ml[:, :, None]
        elif QTYPE == IQ4_XS:
            sub = (e // 32) % 8
            q = (_g(span, off + (e // 256) * 136 + 8 + sub * 16 + i % 16) >> ((i // 16) * 4)) & 15
            sblk = off + (t // 8) * 136
            st = t % 8
            sl = (_g(span, sblk + 4 + st // 2) >> ((st % 2) * 4)) & 15
            sh = (_g(span, sblk + 2 + st // 4) >> ((st % 4) * 2)) & 3
            dl = _f16(span, sblk) * ((sl | (sh << 4)) - 32).to(tl.float32)
            w = dl[:, :, None] * _sub3(_code(kv_ptr, q, BN), BN, NS, 32)
        else:
            tl.static_assert(QTYPE == MXFP4, "unsupported qtype")
            q = (_g(span, off + (e // 32) * 17 + 1 + i % 16) >> ((i // 16) * 4)) & 15
            x = _g(span, off + t * 17)  # [BN, NS] the E8M0 exponent
            subnormal = tl.full(x.shape, 0x00200000, tl.int32) << x
            d = tl.where(x < 2, subnormal, (x - 1) << 23).to(tl.float32, bitcast=True)  # 2**(x - 128)
            w = d[:, :, None] * _sub3(_code(kv_ptr, q, BN), BN, NS, 32)
    return w


@triton.jit
def dq_tile(w_ptr, row_off, rmask, k0, K, kv_ptr, QTYPE: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
            ALIGNED: tl.constexpr):
    """[BN, BK] float32 weights; row_off [BN] int64 bytes, rmask [BN]."""
    BN: tl.constexpr = row_off.shape[0]
    QK: tl.constexpr = 256 if (QTYPE == Q4_K or QTYPE == Q5_K or QTYPE == Q6_K or QTYPE == IQ4_XS) else 32
    BB: tl.constexpr = (144 if QTYPE == Q4_K else 176 if QTYPE == Q5_K else 210 if QTYPE == Q6_K else
                        136 if QTYPE == IQ4_XS else 34 if QTYPE == Q8_0 else 18 if QTYPE == Q4_0 else 17)
    blk0 = k0 // QK
    nbytes = tl.minimum(BK // QK, K // QK - blk0) * BB  # the tile's blocks, fewer in a row's last tile
    start = row_off + blk0 * BB  # [BN]
    off = (start & 15).to(tl.int32)
    base = start - off
    if ALIGNED:
        base = tl.multiple_of(base, 16)
        lim = ((off + nbytes + 15) // 16) * 16
    else:
        lim = off + nbytes
    b = tl.arange(0, SP)[None, :]  # [1, SP]
    span = tl.load(w_ptr + base[:, None] + b, mask=rmask[:, None] & (b < lim[:, None]), other=0)  # [BN, SP]
    w = tl.reshape(_decode(span, off[:, None], kv_ptr, QTYPE, BN, BK), (BN, BK))
    k = k0 + tl.arange(0, BK)[None, :]  # [1, BK]
    return tl.where(k < K, w, 0.0)


@triton.jit
def dequantize_kernel(w_ptr, out_ptr, kv_ptr, N, K, row_bytes,
                      QTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
                      ALIGNED: tl.constexpr):
    """out [N, K] float32 = the weights of w [N, K]; grid (cdiv(N, BN), cdiv(K, BK))."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN]
    k0 = tl.program_id(1) * BK
    w = dq_tile(w_ptr, rows.to(tl.int64) * row_bytes, rows < N, k0, K, kv_ptr, QTYPE, BK, SP, ALIGNED)  # [BN, BK]
    k = k0 + tl.arange(0, BK)[None, :]  # [1, BK]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + k, w, mask=(rows[:, None] < N) & (k < K))
