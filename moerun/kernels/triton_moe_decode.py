"""Routed MoE experts for a few tokens (T <= 16) without sorting (imported by triton_q only when kernels run).

`moe_pair_kernel`: each program takes one (token, choice) pair, or one token and all its choices, and a
range of BN output rows of the expert's matrix. It reads the expert id from the device ids tensor
[T * k], its slot from the lookup lut [ids up to lut_n - 1] (slots = no expert) and the weights' offsets
from base_ptr in the int64 tables by slot: nothing is sorted or counted, nothing comes back to the host.

- GATED (gate and up): out [T * k, I] = act(x_t @ gate^T + bg, x_t @ up^T + bu) for pair p = t * k + j,
  a row t = p // k; pairs without an expert write nothing (the down launch skips them).
- down, one row per pair: out [T * k, H] = w_p * (h_p @ down^T + bd), 0 without an expert;
- down, SUM: out [T, H] (+)= the k choices' rows added in choice order (ACCUM: into what out holds).

Biases are rows of [E, N] float32 tensors by expert id. See triton_moe for the activation and why only
triton's builtins are called.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moerun.kernels.triton_dequant import dq_tile
from moerun.kernels.triton_moe import act, weight_at

INTERPRETED = bool(triton.knobs.runtime.interpret)  # how this module's kernels were built


@triton.jit
def _slot(ids_ptr, p, lut_ptr, lut_n):
    """The slot of pair p's expert (lut_ptr[lut_n - 1], the no-expert slot, for ids outside the lookup)."""
    e = tl.load(ids_ptr + p).to(tl.int64)
    e = tl.where((e >= 0) & (e < lut_n), e, lut_n - 1)
    return e, tl.load(lut_ptr + e)


@triton.jit
def _gemv(a_ptr, w, w_off, nmask, K, kv_ptr, QTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          SP: tl.constexpr, ALIGNED: tl.constexpr):
    """a [K] (one row) @ w's rows at w_off [BN]^T -> [BN] float32."""
    acc = tl.full((BN,), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)  # [BK]
        a = tl.load(a_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        w_t = dq_tile(w, w_off, nmask, k0, K, kv_ptr, QTYPE, BK, SP, ALIGNED)  # [BN, BK]
        acc += tl.reduce(w_t * a[None, :], 1, tl.standard._sum_combine)
    return acc


@triton.jit
def moe_pair_kernel(a_ptr, stride_a, out_ptr, stride_out, ids_ptr, scale_ptr, lut_ptr, lut_n, slots,
                    base_ptr, w_ptr, w2_ptr, row_bytes, row_bytes2, kv_ptr, kv2_ptr, bias_ptr, bias2_ptr, alpha, limit,
                    N, K, KCH,
                    QTYPE: tl.constexpr, QTYPE2: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                    BIAS: tl.constexpr, SUM: tl.constexpr, ACCUM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, SP: tl.constexpr, SP2: tl.constexpr, ALIGNED: tl.constexpr):
    """Grid (pairs T * k, or tokens T with SUM; cdiv(N, BN)). GATED: a = x [T, K] (row p // KCH); else a =
    the hidden rows [T * k, K] (row p). w_ptr / w2_ptr: int64 tables by slot of byte offsets from base_ptr."""
    i = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    nmask = n < N
    w_off = n.to(tl.int64) * row_bytes
    if GATED:
        e, slot = _slot(ids_ptr, i, lut_ptr, lut_n)
        if slot < slots:
            a = a_ptr + (i // KCH) * stride_a
            g = _gemv(a, weight_at(w_ptr, slot, base_ptr, ALIGNED), w_off, nmask, K, kv_ptr, QTYPE, BN, BK, SP, ALIGNED)
            u = _gemv(a, weight_at(w2_ptr, slot, base_ptr, ALIGNED), n.to(tl.int64) * row_bytes2, nmask, K, kv2_ptr, QTYPE2,
                      BN, BK, SP2, ALIGNED)
            if BIAS:
                g += tl.load(bias_ptr + e * N + n, mask=nmask, other=0.0)
                u += tl.load(bias2_ptr + e * N + n, mask=nmask, other=0.0)
            tl.store(out_ptr + i * stride_out + n, act(g, u, alpha, limit, ACT), mask=nmask)
    else:
        if SUM:
            p0 = i * KCH
            n_ch = KCH
        else:
            p0 = i
            n_ch = 1
        acc = tl.full((BN,), 0.0, tl.float32)
        for j in range(n_ch):
            p = p0 + j
            e, slot = _slot(ids_ptr, p, lut_ptr, lut_n)
            if slot < slots:
                y = _gemv(a_ptr + p * stride_a, weight_at(w_ptr, slot, base_ptr, ALIGNED), w_off, nmask, K, kv_ptr, QTYPE, BN,
                          BK, SP, ALIGNED)
                if BIAS:
                    y += tl.load(bias_ptr + e * N + n, mask=nmask, other=0.0)
                acc += y * tl.load(scale_ptr + p)
        out = out_ptr + i * stride_out + n
        if ACCUM:
            acc = tl.load(out, mask=nmask, other=0.0).to(tl.float32) + acc
        tl.store(out, acc, mask=nmask)
