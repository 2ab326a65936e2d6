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

import functools

import torch
import triton
import triton.language as tl

from moerun.kernels import triton_q as tq
from moerun.kernels.triton_dequant import dq_tile
from moerun.quant.qtypes import QType

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
def weight_at(table_ptr, slot, base_ptr, ALIGNED: tl.constexpr):
    """base_ptr + table_ptr[slot]: a slot's weights, from the byte offsets of an int64 table. With ALIGNED
    (the host checked base and offsets) the offset is rounded to 16 in a way the compiler can see (a hint on
    a loaded integer, or an address cast to a pointer, is lost: the weights would be read byte by byte)."""
    off = tl.load(table_ptr + slot)
    if ALIGNED:
        off = (off >> 4) << 4
    return base_ptr + off


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
    each slot's weight offset from w3_ptr. SCALED: out row p *= scale_ptr[p] (p = the row in plain mode).
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
        w = weight_at(w_ptr, slot, w3_ptr, ALIGNED)
        w2 = weight_at(w2_ptr, slot, w3_ptr, ALIGNED)
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
        nb1 = (N + BN - 1) // BN
        if pid_n >= nb1:
            pid_n -= nb1
            col0 = N
            n_seg = N2
            w = w2_ptr
            if SEGS > 2:
                nb2 = (N2 + BN - 1) // BN
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


# ------------------------------------------------------------------------------- warmup, PTX cases


def config_launches(c, dev: torch.device) -> list[tuple]:
    """The launches (kernel, grid, *args, kwargs) a call like `c` makes, on stand-in tensors of its shapes
    (weights: 16 bytes never read; int arguments as the real call passes them)."""
    f32 = functools.partial(torch.zeros, dtype=torch.float32, device=dev)
    qs, opt, t = tuple(QType(q) for q in c.qtypes), set(c.options), c.rows
    blob = torch.zeros(16, dtype=torch.uint8, device=dev)
    norm = (f32(c.k), 1e-6) if "norm" in opt else None
    if c.op == "matmul":
        ns = list(c.n) if isinstance(c.n, tuple) else [c.n]
        out, res = f32((t, sum(ns))), []
        for i in range(0, len(ns), 3):
            part = ns[i:i + 3]
            res.append(tq._qgemm_launch(f32((t, c.k)), out, t, part, c.k, qs[0], [blob] * len(part), norm=norm,
                                     bias=f32(sum(part)) if "bias" in opt else None, accum="accumulate" in opt,
                                     tiles=tq._tiles(t, sum(part), c.k, qs[0])))
        return [(k, g, *a, kw) for k, g, a, kw in res]
    i, h = c.n, c.k
    if c.op == "swiglu":
        hid = f32((t, i))
        k1, g1, a1, kw1 = tq._qgemm_launch(f32((t, h)), hid, t, [i], h, qs[0], [blob, blob], qtype2=qs[1], gated=0,
                                        norm=norm, tiles=tq._tiles(t, i, h, qs[0], qs[1]))
        k2, g2, a2, kw2 = tq._qgemm_launch(hid, f32((t, h)), t, [h], i, qs[2], [blob], accum="accumulate" in opt,
                                        tiles=tq._tiles(t, h, i, qs[2]))
        return [(k1, g1, *a1, kw1), (k2, g2, *a2, kw2)]
    m, e = t * c.choices, c.slots
    table = type("Table", (), {"keys": list(range(e)), "lut": torch.arange(e + 1, dtype=torch.int32, device=dev),
                                   "addrs": torch.zeros((3, e), dtype=torch.int64, device=dev), "aligned": True, "base": blob,
                                   "ids": torch.arange(e, dtype=torch.int32, device=dev)})
    ids = (torch.arange(m, device=dev) % e).to(torch.int64)
    biases = (f32((e, i)), f32((e, i)), f32((e, h)), blob) if "bias" in opt else (blob,) * 4
    fn_args = (tq.ACTS["swiglu_oai" if "oai" in opt else "swiglu"], 1.702, 7.0, biases)
    return tq._moe_launches(f32((t, h)), ids, f32(m), table, qs, (i, h, t, c.choices), fn_args, "pairs" in opt,
                         "accumulate" in opt, f32((m, i)), f32((m, h)), f32((t, h)))


A3B = (2048, 768, 128, 8, 151936)  # Qwen3-30B-A3B: hidden, expert FFN, experts, top-k, vocabulary


def a3b_launches(qtype, rows: int = 1) -> list:
    """The calls of a decode step (rows 1) or prompt step of Qwen3-30B-A3B with every weight in `qtype`: q|k|v
    with the attention norm, o into the residual, the head with the final norm (decode), a dense FFN (norm,
    into the residual) and the routed experts into the residual."""
    h, i, e, k, v = A3B
    q = (qtype,)
    calls = [tq.Launch("matmul", q, (4096, 512, 512), h, rows, frozenset({"norm"})),
             tq.Launch("matmul", q, h, 4096, rows, frozenset({"accumulate"})),
             tq.Launch("swiglu", q * 3, i, h, rows, frozenset({"norm", "accumulate"})),
             tq.Launch("moe", q * 3, i, h, rows, frozenset({"accumulate"}), k, e)]
    return calls + [tq.Launch("matmul", q, v, h, 1, frozenset({"norm"}))] if rows == 1 else calls


def gptoss_launches(qtype, rows: int = 1) -> list:
    """gpt-oss-style calls (biases on q|k|v; routed experts with the clamped SwiGLU and biases, pair rows)
    on a3b's shapes (gpt-oss's 2880 is no multiple of 256: K-quants could not hold it)."""
    h, i, e, k, _ = A3B
    return [tq.Launch("matmul", (qtype,), (4096, 512, 512), h, rows, frozenset({"bias"})),
            tq.Launch("moe", (qtype,) * 3, i, h, rows, frozenset({"oai", "bias", "pairs"}), k, e)]


def _calls():
    """Every qtype's decode calls, its o-projection and routed experts of a 512-row prompt (the tl.dot tiles,
    the sorted MoE); on Q4_K also 2 and 16 rows (the broadcast and the 16-row tl.dot tiles, the pair MoE's
    wider tiles); gpt-oss's options on Q8_0, MXFP4 and Q4_K (biases, clamped SwiGLU, pair rows)."""
    for qtype in sorted(tq.SUPPORTED):
        yield from a3b_launches(qtype, 1)
        yield from (c for c in a3b_launches(qtype, 512) if c.op == "moe" or "accumulate" in c.options and
                    c.op == "matmul")
        if qtype in (QType.Q8_0, QType.MXFP4, QType.Q4_K):
            yield from (c for c in gptoss_launches(qtype, 1) if c.op == "moe" or qtype == QType.Q8_0)
    yield from gptoss_launches(QType.MXFP4, 512)
    yield tq.Launch("matmul", (QType.Q4_K,), A3B[0], 4096, 2, frozenset({"accumulate"}))
    yield from (c for c in a3b_launches(QType.Q4_K, 16) if c.op == "moe" or "norm" in c.options)


def ptx_cases() -> list[tuple]:
    """(name, jit function, signature, constexprs, attrs, options) of each launch configuration of _calls()
    (Qwen3-30B-A3B's shapes), with the integer and pointer specialisation (divisibility by 16, the value 1) a
    real launch gets from triton's own binder for the CUDA backend."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    cases, seen = [], set()
    for c in _calls():
        for j, (kernel, _, *args) in enumerate(config_launches(c, torch.device("cpu"))):
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            bound, spec, opts = binder(*args[:-1], **args[-1])
            opts, sig, consts, attrs = kernel._pack_args(backend, args[-1], bound, spec, opts)
            key = (kernel.__name__, str(sig), str(sorted(consts.items())), str(attrs), opts.num_warps)
            if key not in seen:
                seen.add(key)
                n = "x".join(map(str, c.n)) if isinstance(c.n, tuple) else c.n
                name = (f"{QType(c.qtypes[0]).name}_t{c.rows}_{c.op}{j}_{n}x{c.k}_{'_'.join(sorted(c.options))}_"
                        f"{kernel.__name__}")
                cases.append((name, kernel, sig, consts, attrs, {"num_warps": opts.num_warps,
                                                              "num_stages": opts.num_stages}))
    return cases

