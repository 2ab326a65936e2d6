"""The Triton GEMM over GGUF blocks (imported by triton_q only when kernels run).

One kernel, `qgemm_kernel`, in two layouts chosen at compile time:

- plain: out [M, N] = a [M, K] @ w[N, K]^T, w the raw blocks of one weight (decode GEMV and prefill);
- grouped: MoE experts. The (token, choice) pairs are sorted by expert; a tile table gives each program
  its expert slot and a range of sorted rows. Each slot has its own weight address (an int64 table), so
  experts stay wherever their buffers are.

GATED computes silu(a @ w^T) * (a @ w2^T) from the same activation tile (an expert's gate and up in one
pass); SCALED multiplies each output row by a per-pair routing weight. Weights are dequantized in
registers tile by tile (triton_dequant.dq_tile); activations and accumulators stay float32.

Only triton's builtins are called, not its @jit library (tl.zeros, tl.sum): the library is built once,
when triton is imported, and triton_q may rebuild these kernels later under another TRITON_INTERPRET;
an interpreted kernel cannot call a compiled library function. tl.sum is written as tl.reduce with the
library's own combine function, which the interpreter recognises and runs as one numpy sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moerun.kernels.triton_dequant import dq_tile

INTERPRETED = bool(triton.knobs.runtime.interpret)  # how this module's kernels were built


@triton.jit
def _dot(acc, a, w, USE_DOT: tl.constexpr):
    """acc [BM, BN] += a [BM, BK] @ w [BN, BK]^T in float32 (tl.dot needs BM, BN, BK >= 16)."""
    if USE_DOT:
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        acc += tl.reduce(a[:, None, :] * w[None, :, :], 2, tl.standard._sum_combine)  # tl.sum
    return acc


@triton.jit
def qgemm_kernel(a_ptr, stride_a, out_ptr, stride_out, pair_ptr, a_div, scale_ptr, tiles_ptr,
                 w_ptr, w2_ptr, row_bytes, row_bytes2, kv_ptr, kv2_ptr, M, N, K,
                 QTYPE: tl.constexpr, QTYPE2: tl.constexpr, GROUPED: tl.constexpr, GATED: tl.constexpr,
                 SCALED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 USE_DOT: tl.constexpr):
    """Grid (row tiles, cdiv(N, BN)).

    plain: rows pid*BM.. of a [M, K] and out [M, N]; w_ptr / w2_ptr are the weights' bytes.
    grouped: tiles_ptr [tiles, 3] int32 = (slot or -1, first sorted row, end); sorted row r is pair
    p = pair_ptr[r], reading a row p // a_div and writing out row p; w_ptr / w2_ptr are int64 tables of
    each slot's weight address. SCALED: out row p *= scale_ptr[p] (p = the row in plain mode).
    """
    if GROUPED:
        tile = tiles_ptr + 3 * tl.program_id(0)
        slot = tl.load(tile)
        if slot < 0:
            return
        r = tl.load(tile + 1) + tl.arange(0, BM)  # [BM]
        rmask = r < tl.load(tile + 2)
        o_row = tl.load(pair_ptr + r, mask=rmask, other=0)
        a_row = o_row // a_div
        w = tl.load(w_ptr + slot).to(tl.pointer_type(tl.uint8))
        w2 = tl.load(w2_ptr + slot).to(tl.pointer_type(tl.uint8))
    else:
        r = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = r < M
        o_row = r
        a_row = r
        w = w_ptr
        w2 = w2_ptr
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    nmask = n < N
    a_off = a_row[:, None].to(tl.int64) * stride_a  # [BM, 1]
    w_off = n.to(tl.int64) * row_bytes  # [BN]
    w2_off = n.to(tl.int64) * row_bytes2
    acc = tl.full((BM, BN), 0.0, tl.float32)
    acc2 = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)[None, :]  # [1, BK]
        a = tl.load(a_ptr + a_off + k, mask=rmask[:, None] & (k < K), other=0.0).to(tl.float32)  # [BM, BK]
        acc = _dot(acc, a, dq_tile(w, w_off, nmask, k0, K, kv_ptr, QTYPE, BK), USE_DOT)
        if GATED:
            acc2 = _dot(acc2, a, dq_tile(w2, w2_off, nmask, k0, K, kv2_ptr, QTYPE2, BK), USE_DOT)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if SCALED:
        acc = acc * tl.load(scale_ptr + o_row, mask=rmask, other=0.0)[:, None]
    out = out_ptr + o_row[:, None].to(tl.int64) * stride_out + n[None, :]  # [BM, BN]
    tl.store(out, acc, mask=rmask[:, None] & nmask[None, :])
