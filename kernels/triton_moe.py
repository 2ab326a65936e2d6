"""The Triton GEMM over GGUF blocks (imported by triton_q only when kernels run).

`qgemm_kernel`, in two layouts chosen at compile time:

- plain: out [M, N] = a [M, K] @ w[N, K]^T, w the raw blocks of one weight (decode GEMV and prefill); with
  SEGS = 2 or 3, up to three weights of one type and K side by side (q|k|v): out [M, N + N2 + N3], each
  program in one weight's column range;
- grouped: MoE experts. The (token, choice) pairs are sorted by expert; a tile table gives each program
  its expert slot and a range of sorted rows. Each slot has its own weight address (an int64 table), so
  experts stay wherever their buffers are.

Options (constexpr): NORM: a's rows are RMS-normalised (each program computes its rows' 1/rms over K)
and multiplied by norm_ptr [K] first. GATED: act(a @ w^T, a @ w2^T) from the same activation tile (an
expert's gate and up in one pass), ACT 0 silu(g) * u, 1 gpt-oss's clamped SwiGLU (alpha, limit). BIAS:
plain, bias_ptr [N + N2 + N3] added; grouped, rows of bias_ptr (gate or down) and bias2_ptr (up) [E, N]
by expert id (keys_ptr: slot -> id). SCALED: each output row times a per-pair routing weight. ACCUM: the
result is added to what out holds (a residual). Weights are dequantized in registers tile by tile
(triton_dequant.dq_tile); activations and accumulators stay float32.

`sum_pairs_kernel`: [T * k, H] pair rows -> [T, H], the k choices added in order (+ out with ACCUM).

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
def act(g, u, alpha, limit, ACT: tl.constexpr):
    """silu(g) * u (ACT 0), or gpt-oss's min(g, limit) * sigmoid(alpha g) * (clamp(u, +-limit) + 1) (ACT 1)."""
    if ACT == 0:
        h = g / (1.0 + tl.exp(-g)) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g * (1.0 / (1.0 + tl.exp(-(alpha * g)))) * (u + 1.0)
    return h


@triton.jit
def weight_at(table_ptr, slot, ALIGNED: tl.constexpr):
    """The uint8 pointer held at table_ptr[slot] (16-byte aligned with ALIGNED: the host checked)."""
    addr = tl.load(table_ptr + slot)
    if ALIGNED:
        addr = tl.multiple_of(addr, 16)
    return addr.to(tl.pointer_type(tl.uint8))


@triton.jit
def _rstd(a_ptr, a_off, rmask, K, eps, BM: tl.constexpr, BK: tl.constexpr):
    """1 / rms of each of the BM rows at a_off [BM, 1] over K; [BM, 1]."""
    ss = tl.full((BM, 1), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)[None, :]
        a = tl.load(a_ptr + a_off + k, mask=rmask[:, None] & (k < K), other=0.0).to(tl.float32)
        ss += tl.reduce(a * a, 1, tl.standard._sum_combine, keep_dims=True)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def qgemm_kernel(a_ptr, stride_a, out_ptr, stride_out, pair_ptr, a_div, scale_ptr, tiles_ptr, keys_ptr,
                 w_ptr, w2_ptr, w3_ptr, row_bytes, row_bytes2, kv_ptr, kv2_ptr, bias_ptr, bias2_ptr, norm_ptr,
                 eps, alpha, limit, M, N, N2, N3, K,
                 QTYPE: tl.constexpr, QTYPE2: tl.constexpr, GROUPED: tl.constexpr, GATED: tl.constexpr,
                 ACT: tl.constexpr, SCALED: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                 ACCUM: tl.constexpr, SEGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SP: tl.constexpr, SP2: tl.constexpr, ALIGNED: tl.constexpr, USE_DOT: tl.constexpr):
    """Grid (row tiles, column tiles: cdiv(N, BN) (+ cdiv(N2, BN) + cdiv(N3, BN))).

    plain: rows pid*BM.. of a [M, K] and out [M, *]; w_ptr, w2_ptr, w3_ptr are the weights' bytes.
    grouped: tiles_ptr [tiles, 3] int32 = (slot or -1, first sorted row, end); sorted row r is pair
    p = pair_ptr[r], reading a row p // a_div and writing out row p; w_ptr / w2_ptr are int64 tables of
    each slot's weight address. SCALED: out row p *= scale_ptr[p] (p = the row in plain mode).
    """
    eid = 0
    if GROUPED:
        tile = tiles_ptr + 3 * tl.program_id(0)
        slot = tl.load(tile)
        if slot < 0:
            return
        r = tl.load(tile + 1) + tl.arange(0, BM)  # [BM]
        rmask = r < tl.load(tile + 2)
        o_row = tl.load(pair_ptr + r, mask=rmask, other=0)
        a_row = o_row // a_div
        w = weight_at(w_ptr, slot, ALIGNED)
        w2 = weight_at(w2_ptr, slot, ALIGNED)
        if BIAS:
            eid = tl.load(keys_ptr + slot).to(tl.int64)
    else:
        r = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = r < M
        o_row = r
        a_row = r
        w = w_ptr
        w2 = w2_ptr
    pid_n = tl.program_id(1)
    n_seg = N
    col0 = 0
    if SEGS > 1:
        nb1 = tl.cdiv(N, BN)
        if pid_n >= nb1:
            pid_n -= nb1
            col0 = N
            n_seg = N2
            w = w2_ptr
            if SEGS > 2:
                nb2 = tl.cdiv(N2, BN)
                if pid_n >= nb2:
                    pid_n -= nb2
                    col0 = N + N2
                    n_seg = N3
                    w = w3_ptr
    n = pid_n * BN + tl.arange(0, BN)  # [BN] within the weight
    nmask = n < n_seg
    a_off = a_row[:, None].to(tl.int64) * stride_a  # [BM, 1]
    if NORM:
        rstd = _rstd(a_ptr, a_off, rmask, K, eps, BM, BK)
    w_off = n.to(tl.int64) * row_bytes  # [BN]
    w2_off = n.to(tl.int64) * row_bytes2
    acc = tl.full((BM, BN), 0.0, tl.float32)
    acc2 = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)[None, :]  # [1, BK]
        a = tl.load(a_ptr + a_off + k, mask=rmask[:, None] & (k < K), other=0.0).to(tl.float32)  # [BM, BK]
        if NORM:
            a = a * rstd * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc = _dot(acc, a, dq_tile(w, w_off, nmask, k0, K, kv_ptr, QTYPE, BK, SP, ALIGNED), USE_DOT)
        if GATED:
            acc2 = _dot(acc2, a, dq_tile(w2, w2_off, nmask, k0, K, kv2_ptr, QTYPE2, BK, SP2, ALIGNED), USE_DOT)
    col = col0 + n  # [BN] output column
    if BIAS:
        if GROUPED:
            acc += tl.load(bias_ptr + eid * N + n, mask=nmask, other=0.0)[None, :]
            if GATED:
                acc2 += tl.load(bias2_ptr + eid * N + n, mask=nmask, other=0.0)[None, :]
        else:
            acc += tl.load(bias_ptr + col, mask=nmask, other=0.0)[None, :]
    if GATED:
        acc = act(acc, acc2, alpha, limit, ACT)
    if SCALED:
        acc = acc * tl.load(scale_ptr + o_row, mask=rmask, other=0.0)[:, None]
    out = out_ptr + o_row[:, None].to(tl.int64) * stride_out + col[None, :]  # [BM, BN]
    omask = rmask[:, None] & nmask[None, :]
    if ACCUM:
        acc = tl.load(out, mask=omask, other=0.0).to(tl.float32) + acc
    tl.store(out, acc, mask=omask)


@triton.jit
def sum_pairs_kernel(y_ptr, out_ptr, stride_out, H, KCH, ACCUM: tl.constexpr, BH: tl.constexpr):
    """out[t] (+)= y[t*KCH] + y[t*KCH + 1] + ... in that order; y [T * KCH, H] float32; grid (T, cdiv(H, BH))."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)  # [BH]
    hmask = h < H
    acc = tl.load(y_ptr + t * KCH * H + h, mask=hmask, other=0.0)
    for j in range(1, KCH):
        acc += tl.load(y_ptr + (t * KCH + j) * H + h, mask=hmask, other=0.0)
    out = out_ptr + t * stride_out + h
    if ACCUM:
        acc = tl.load(out, mask=hmask, other=0.0).to(tl.float32) + acc
    tl.store(out, acc, mask=hmask)
