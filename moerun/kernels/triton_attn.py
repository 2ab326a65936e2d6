"""The decode step's attention kernels in Triton, one launch each, for CUDA graph capture.

    qk_rope_kv_write(qkv, positions, slots, k_cache, v_cache, q_out, ...)  q, k normed + rotated; k, v cached
    decode_attention(q, k_cache, v_cache, block_table, lengths, out, ...)  one query per row over its cache

Every input is on the device and every grid comes from shapes (a batch-size bucket, the pool's table
width), never from values: no host synchronisation, nothing allocated when the output and workspace
buffers are given. Launches go through moerun.device.launch. Rows of a bucket past the real batch are
harmless: slot < 0 writes nothing, length 0 attends to nothing (zeros out).

Cache layout (moerun.engine.kv_cache): k [S, nkv, D], v [S, nkv, Dv] of one layer; position p of row b
is in slot block_table[b, j] * block_size + p % block_size, j = p // block_size, or j = (p // block_size)
% ring for a sliding-window layer's ring (its table then lists the ring's blocks). block_size 1 makes the
table a slot per position.

Long caches are split over key ranges (flash-decoding): grid (B, nkv, splits), splits fixed by
max_positions (or the window) and B. Each program leaves its partial softmax in a workspace; the last
program of a (row, kv head) to finish (an atomic counter, reset by it) merges the partials in split order,
so the result does not depend on which program finishes last.

Only triton builtins and the library's combine functions go into kernels (see triton_q): the module is
built under the TRITON_INTERPRET of its import (INTERPRETED).
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from moerun import device

__all__ = ["attention_splits", "attention_workspace", "decode_attention", "ptx_cases", "ptx_options",
           "qk_rope_kv_write"]

INTERPRETED = bool(triton.knobs.runtime.interpret)
TARGET_PROGRAMS = 256  # programs a split attention launch aims for (about two waves on an H100/H200)
MIN_CHUNK = 256  # positions per split at least
BLOCK_N = 32  # keys per step (64 spills at head_dim 128 with 4 warps on sm_90: cuobjdump -res-usage)


@triton.jit
def _rowsum(x):
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def _rowmax(x):
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _norm_rope(src, d, dmask, pos_f, inv_ptr, nw_ptr, eps, attn_factor, D: tl.constexpr, R: tl.constexpr,
               NEOX: tl.constexpr, NORM: tl.constexpr):
    """One head [BD] at src: RMS-normed by nw_ptr (NORM), the first R dims rotated at pos_f (float32)."""
    x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    rot = d < R
    if NEOX:
        half = d < R // 2
        partner = tl.where(half, d + R // 2, d - R // 2)
        i = tl.where(half, d, d - R // 2)
    else:
        half = d % 2 == 0
        partner = tl.where(half, d + 1, d - 1)
        i = d // 2
    partner = tl.where(rot, partner, d)
    i = tl.where(rot, i, 0)
    xp = tl.load(src + partner, mask=dmask, other=0.0).to(tl.float32)
    if NORM:
        r = 1.0 / tl.sqrt(tl.reduce(x * x, 0, tl.standard._sum_combine) / D + eps)
        x = tl.load(nw_ptr + d, mask=dmask, other=0.0).to(tl.float32) * (x * r)
        xp = tl.load(nw_ptr + partner, mask=dmask, other=0.0).to(tl.float32) * (xp * r)
    f = pos_f * tl.load(inv_ptr + i, mask=rot, other=0.0)
    c = tl.cos(f) * attn_factor
    s = tl.sin(f) * attn_factor
    y = tl.where(half, x * c - xp * s, x * c + xp * s)
    return tl.where(rot, y, x)


@triton.jit
def qk_rope_kernel(qkv_ptr, stride_qkv, pos_ptr, slot_ptr, k_ptr, v_ptr, stride_k, stride_v, q_ptr, stride_q,
                   gate_ptr, stride_gate, inv_ptr, qn_ptr, kn_ptr, eps, attn_factor,
                   NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
                   NEOX: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr, BD: tl.constexpr,
                   BDV: tl.constexpr):
    """Grid (B, NH + NKV): program (b, h) is q head h of row b, or kv head h - NH."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = qkv_ptr + b.to(tl.int64) * stride_qkv  # [NH * QW + NKV * D + NKV * DV]
    QW: tl.constexpr = 2 * D if GATE else D
    d = tl.arange(0, BD)
    dmask = d < D
    pos_f = tl.load(pos_ptr + b).to(tl.float32)
    if h < NH:
        y = _norm_rope(row + h * QW, d, dmask, pos_f, inv_ptr, qn_ptr, eps, attn_factor, D, R, NEOX, NORM)
        tl.store(q_ptr + b.to(tl.int64) * stride_q + h * D + d, y.to(q_ptr.dtype.element_ty), mask=dmask)
        if GATE:
            g = tl.load(row + h * QW + D + d, mask=dmask, other=0.0)
            tl.store(gate_ptr + b.to(tl.int64) * stride_gate + h * D + d, g.to(gate_ptr.dtype.element_ty),
                     mask=dmask)
    else:
        kvh = h - NH
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if slot >= 0:
            y = _norm_rope(row + NH * QW + kvh * D, d, dmask, pos_f, inv_ptr, kn_ptr, eps, attn_factor, D, R,
                           NEOX, NORM)
            tl.store(k_ptr + slot * stride_k + kvh * D + d, y.to(k_ptr.dtype.element_ty), mask=dmask)
            dv = tl.arange(0, BDV)
            vmask = dv < DV
            v = tl.load(row + NH * QW + NKV * D + kvh * DV + dv, mask=vmask, other=0.0)
            tl.store(v_ptr + slot * stride_v + kvh * DV + dv, v.to(v_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def _finish(m, l, acc, b, g, hq, hmask, dv, dvmask, out_ptr, stride_out, sink_ptr, gate_ptr, stride_gate,
            G: tl.constexpr, DV: tl.constexpr, SINKS: tl.constexpr, GATE: tl.constexpr):
    """out rows of heads g*G + hq = acc / l, with the sink logit in the denominator and the gate applied."""
    if SINKS:
        sk = tl.load(sink_ptr + g * G + hq, mask=hmask, other=float("-inf")).to(tl.float32)
        mn = tl.maximum(m, sk)
        mn = tl.where(mn == float("-inf"), 0.0, mn)
        a = tl.exp(m - mn)
        l = l * a + tl.exp(sk - mn)
        acc = acc * a[:, None]
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # [BG, BDV]; no key and no sink: zeros
    col = (g * G + hq)[:, None] * DV + dv[None, :]
    mask = hmask[:, None] & dvmask[None, :]
    if GATE:
        gt = tl.load(gate_ptr + b.to(tl.int64) * stride_gate + col, mask=mask, other=0.0).to(tl.float32)
        o = o * (1.0 / (1.0 + tl.exp(-gt)))
    tl.store(out_ptr + b.to(tl.int64) * stride_out + col, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, tbl_ptr, len_ptr, out_ptr, sink_ptr, gate_ptr, ws_ptr, cnt_ptr,
                     stride_q, stride_k, stride_v, stride_tbl, stride_out, stride_gate, scale,
                     NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
                     RING: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, NSPLIT: tl.constexpr,
                     SINKS: tl.constexpr, GATE: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
                     BDV: tl.constexpr, BN: tl.constexpr, MMA: tl.constexpr):
    """Grid (B, NKV, NSPLIT): the G query heads of kv head g of row b over visible keys [lo + s*CHUNK, ..).
    MMA: q and the probabilities in the caches' 16-bit type for the tensor cores (float32 accumulation);
    else every product in float32."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(len_ptr + b)
    lo = length * 0
    if WINDOW > 0:
        lo = tl.maximum(length - WINDOW, 0)
    start = lo + sp * CHUNK
    end = tl.minimum(length, start + CHUNK)
    hq = tl.arange(0, BG)
    hmask = hq < G
    d = tl.arange(0, BD)
    dmask = d < D
    dv = tl.arange(0, BDV)
    dvmask = dv < DV
    q = tl.load(q_ptr + b.to(tl.int64) * stride_q + (g * G + hq)[:, None] * D + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * scale  # [BG, BD]
    m = tl.full((BG,), float("-inf"), tl.float32)
    l = tl.full((BG,), 0.0, tl.float32)
    acc = tl.full((BG, BDV), 0.0, tl.float32)
    tbl = tbl_ptr + b.to(tl.int64) * stride_tbl
    for n0 in range(start, end, BN):
        p = n0 + tl.arange(0, BN)  # [BN]
        pm = p < end
        j = p // BS
        if RING > 0:
            j = j % RING
        slot = tl.load(tbl + j, mask=pm, other=0).to(tl.int64) * BS + p % BS
        k = tl.load(k_ptr + slot[:, None] * stride_k + g * D + d[None, :], mask=pm[:, None] & dmask[None, :],
                    other=0.0)  # [BN, BD]
        if MMA:
            s = tl.dot(q.to(k.dtype), tl.trans(k))  # [BG, BN]
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = tl.where(pm[None, :], s, float("-inf"))
        m_new = tl.maximum(m, _rowmax(s))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new[:, None])
        l = l * alpha + _rowsum(pr)
        vmask = pm[:, None] & dvmask[None, :]
        v = tl.load(v_ptr + slot[:, None] * stride_v + g * DV + dv[None, :], mask=vmask, other=0.0)
        if MMA:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        m = m_new
    if NSPLIT == 1:
        _finish(m, l, acc, b, g, hq, hmask, dv, dvmask, out_ptr, stride_out, sink_ptr, gate_ptr, stride_gate,
                G, DV, SINKS, GATE)
    else:
        REGION: tl.constexpr = BG * (BDV + 2)  # one partial: acc [BG, BDV], m [BG], l [BG]
        pair = b.to(tl.int64) * NKV + g
        ws = ws_ptr + pair * (NSPLIT * REGION)
        part = ws + sp * REGION
        tl.store(part + hq[:, None] * BDV + dv[None, :], acc)
        tl.store(part + BG * BDV + hq, m)
        tl.store(part + BG * BDV + BG + hq, l)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if done == NSPLIT - 1:
            m = tl.full((BG,), float("-inf"), tl.float32)
            l = tl.full((BG,), 0.0, tl.float32)
            acc = tl.full((BG, BDV), 0.0, tl.float32)
            for s in range(NSPLIT):
                part = ws + s * REGION
                ms = tl.load(part + BG * BDV + hq, cache_modifier=".cg")
                ls = tl.load(part + BG * BDV + BG + hq, cache_modifier=".cg")
                acs = tl.load(part + hq[:, None] * BDV + dv[None, :], cache_modifier=".cg")
                mn = tl.maximum(m, ms)
                mn = tl.where(mn == float("-inf"), 0.0, mn)
                a1 = tl.exp(m - mn)
                a2 = tl.exp(ms - mn)
                l = l * a1 + ls * a2
                acc = acc * a1[:, None] + acs * a2[:, None]
                m = tl.maximum(m, ms)
            _finish(m, l, acc, b, g, hq, hmask, dv, dvmask, out_ptr, stride_out, sink_ptr, gate_ptr,
                    stride_gate, G, DV, SINKS, GATE)
            tl.atomic_xchg(cnt_ptr + pair, 0, sem="relaxed", scope="gpu")


# ------------------------------------------------------------------------------------------ wrappers


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def qk_rope_kv_write(qkv, positions, slots, k_cache, v_cache, q_out, *, n_heads: int, n_kv_heads: int,
                     head_dim: int, inv_freq, rotary_dim: int | None = None, rope_style: str = "neox",
                     attn_factor: float = 1.0, q_norm=None, k_norm=None, eps: float = 1e-6, gate_out=None,
                     v_head_dim: int | None = None):
    """One launch: q [B, nh, D] into q_out; k and v of each row into the caches at slots [B].

    qkv [B, Nq + nkv*D + nkv*Dv] (any float dtype; rows may be strided, columns contiguous): Nq = nh*D, or
    nh*2D with gate_out [B, nh*D] given (each head's q followed by its output gate, which is copied to
    gate_out). positions [B] int32/int64, slots [B] int32/int64 (< 0: no write). q_norm / k_norm [D]: the
    head-wise RMS norm (eps) before RoPE. inv_freq [rotary_dim / 2] float32 (YaRN folded in); cos and sin
    are multiplied by attn_factor. The first rotary_dim dims rotate ("neox": halves, "interleaved":
    adjacent pairs), the rest pass through. Caches [S, nkv, D|Dv] of any float dtype, rows contiguous.
    Returns q_out."""
    dv = v_head_dim or head_dim
    r = rotary_dim or head_dim
    b = qkv.shape[0]
    qw = (2 if gate_out is not None else 1) * n_heads * head_dim
    if qkv.shape[1] != qw + n_kv_heads * (head_dim + dv) or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [B, {qw} + {n_kv_heads * (head_dim + dv)}] with "
                         "contiguous rows")
    if r % 2 or r > head_dim or rope_style not in ("neox", "interleaved") or inv_freq.numel() != r // 2:
        raise ValueError(f"rotary_dim {r}, rope_style {rope_style!r}, inv_freq {tuple(inv_freq.shape)} "
                         f"do not fit head_dim {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    _check_cache(k_cache, n_kv_heads, head_dim, "k_cache")
    _check_cache(v_cache, n_kv_heads, dv, "v_cache")
    if tuple(q_out.shape) != (b, n_heads, head_dim) or not q_out.is_contiguous():
        raise ValueError(f"q_out must be contiguous [{b}, {n_heads}, {head_dim}], got {tuple(q_out.shape)}")
    if b == 0:
        return q_out
    gate = gate_out if gate_out is not None else q_out
    norm = q_norm is not None
    device.launch(qk_rope_kernel, (b, n_heads + n_kv_heads), qkv, qkv.stride(0), positions, slots, k_cache,
                  v_cache, k_cache.stride(0), v_cache.stride(0), q_out, q_out.stride(0), gate, gate.stride(0),
                  inv_freq, q_norm if norm else inv_freq, k_norm if norm else inv_freq, float(eps),
                  float(attn_factor), NH=n_heads, NKV=n_kv_heads, D=head_dim, DV=dv, R=r,
                  NEOX=rope_style == "neox", NORM=norm, GATE=gate_out is not None, BD=_pow2(head_dim),
                  BDV=_pow2(dv), num_warps=4 if max(head_dim, dv) <= 256 else 8)
    return q_out


def _check_cache(c, nkv: int, d: int, name: str) -> None:
    if c.dim() != 3 or tuple(c.shape[1:]) != (nkv, d) or c.stride(2) != 1 or c.stride(1) != d:
        raise ValueError(f"{name} must be [S, {nkv}, {d}] with contiguous rows, got {tuple(c.shape)}")


def attention_splits(batch: int, n_kv_heads: int, max_positions: int, window: int = 0) -> tuple[int, int]:
    """(splits, positions per split) of decode_attention for a bucket: from shapes only."""
    span = min(window, max_positions) if window else max_positions
    want = max(1, min(_cdiv(span, MIN_CHUNK), _cdiv(TARGET_PROGRAMS, max(1, batch * n_kv_heads))))
    chunk = _cdiv(_cdiv(max(span, 1), want), BLOCK_N) * BLOCK_N
    return _cdiv(max(span, 1), chunk), chunk


def attention_workspace(batch: int, n_heads: int, n_kv_heads: int, v_head_dim: int, splits: int, device_):
    """(partials float32, counters int32 zeros) for decode_attention with `splits` > 1: allocated once per
    bucket, reused by every layer and step (the launch that uses the counters leaves them at zero)."""
    import torch

    g = _pow2(n_heads // n_kv_heads, 16)
    region = g * (_pow2(v_head_dim) + 2)
    return (torch.empty(batch * n_kv_heads * splits * region, dtype=torch.float32, device=device_),
            torch.zeros(batch * n_kv_heads, dtype=torch.int32, device=device_))


def decode_attention(q, k_cache, v_cache, block_table, lengths, out, *, scale: float, block_size: int = 1,
                     ring: int = 0, window: int = 0, sinks=None, gate=None, max_positions: int | None = None,
                     splits: int | None = None, workspace=None, precise: bool = False):
    """One launch: out [B, nh*Dv] = softmax(scale * q k^T) v of each row's last query over its cache.

    q [B, nh, D] contiguous; k_cache [S, nkv, D], v_cache [S, nkv, Dv] (any float dtype, rows contiguous);
    block_table [B, W] int32 (module docstring: block_size, ring); lengths [B] int32: positions visible,
    the new one included (0: zeros out). window: only the last `window` positions. sinks [nh]: one more
    logit per head in the denominator (gpt-oss). gate [B, nh*Dv]: out *= sigmoid(gate). GQA: head h reads
    kv head h // (nh / nkv). max_positions (default W * block_size, or the window) and B fix the split
    (attention_splits); with splits > 1 pass workspace=attention_workspace(...) to allocate nothing.
    Float32 softmax and accumulation; with 16-bit caches q and the probabilities go to the tensor cores in
    the caches' type unless `precise` (every product in float32). out in its own dtype. Returns out."""
    b, nh, d = q.shape
    _, nkv, _ = k_cache.shape
    dv = v_cache.shape[2]
    _check_cache(k_cache, nkv, d, "k_cache")
    _check_cache(v_cache, nkv, dv, "v_cache")
    if nh % nkv or not q.is_contiguous():
        raise ValueError(f"q must be contiguous [B, nh, D] with nh a multiple of {nkv}, got {tuple(q.shape)}")
    if tuple(out.shape) != (b, nh * dv) or out.stride(1) != 1:
        raise ValueError(f"out must be [{b}, {nh * dv}] with contiguous rows, got {tuple(out.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [{b}, W] with contiguous rows, got {tuple(block_table.shape)}")
    if gate is not None and (tuple(gate.shape) != (b, nh * dv) or gate.stride(1) != 1):
        raise ValueError(f"gate must be [{b}, {nh * dv}], got {tuple(gate.shape)}")
    if b == 0:
        return out
    if max_positions is None:
        max_positions = block_table.shape[1] * block_size
    n, chunk = attention_splits(b, nkv, max_positions, window)
    if splits is not None:
        span = min(window, max_positions) if window else max_positions
        n, chunk = splits, _cdiv(_cdiv(max(span, 1), splits), BLOCK_N) * BLOCK_N
    if n > 1 and workspace is None:
        workspace = attention_workspace(b, nh, nkv, dv, n, q.device)
    ws, cnt = workspace if n > 1 else (out, block_table)
    g = nh // nkv
    gt = gate if gate is not None else out
    mma = not precise and k_cache.dtype == v_cache.dtype and k_cache.element_size() == 2
    device.launch(attention_kernel, (b, nkv, n), q, k_cache, v_cache, block_table, lengths, out,
                  sinks if sinks is not None else out, gt, ws, cnt, q.stride(0), k_cache.stride(0),
                  v_cache.stride(0), block_table.stride(0), out.stride(0), gt.stride(0), float(scale),
                  NKV=nkv, G=g, D=d, DV=dv, BS=block_size, RING=ring, WINDOW=window, CHUNK=chunk, NSPLIT=n,
                  SINKS=sinks is not None, GATE=gate is not None, BG=_pow2(g, 16), BD=_pow2(d, 16),
                  BDV=_pow2(dv, 16), BN=BLOCK_N, MMA=mma, num_warps=4 if mma else 8)
    return out


# ------------------------------------------------------------------------------------------ compile cases


def _signature(fn, types: dict, consts: dict) -> dict:
    """Every parameter of fn: its type from `types`, or "constexpr" where `consts` holds it."""
    names = inspect.signature(fn.fn).parameters  # fn.fn: the Python function, compiled or interpreted
    return {n: "constexpr" if n in consts else types[n] for n in names}


def _rope_case(name, nh, nkv, d, r, neox, norm, gate, cache="bf16", act="fp32"):
    types = {"qkv_ptr": f"*{act}", "stride_qkv": "i32", "pos_ptr": "*i32", "slot_ptr": "*i32",
             "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "stride_k": "i32", "stride_v": "i32",
             "q_ptr": f"*{act}", "stride_q": "i32", "gate_ptr": f"*{act}", "stride_gate": "i32",
             "inv_ptr": "*fp32", "qn_ptr": f"*{act}", "kn_ptr": f"*{act}", "eps": "fp32",
             "attn_factor": "fp32"}
    consts = {"NH": nh, "NKV": nkv, "D": d, "DV": d, "R": r, "NEOX": neox, "NORM": norm, "GATE": gate,
              "BD": _pow2(d), "BDV": _pow2(d)}
    return name, qk_rope_kernel, _signature(qk_rope_kernel, types, consts), consts


def _attn_case(name, nh, nkv, d, splits, chunk, bs=16, ring=0, window=0, sinks=False, gate=False,
               cache="bf16", act="fp32", mma=None):
    types = {"q_ptr": f"*{act}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "tbl_ptr": "*i32",
             "len_ptr": "*i32", "out_ptr": f"*{act}", "sink_ptr": "*fp32", "gate_ptr": f"*{act}",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32", "scale": "fp32",
             **dict.fromkeys(("stride_q", "stride_k", "stride_v", "stride_tbl", "stride_out", "stride_gate"),
                             "i32")}
    g = nh // nkv
    consts = {"NKV": nkv, "G": g, "D": d, "DV": d, "BS": bs, "RING": ring, "WINDOW": window, "CHUNK": chunk,
              "NSPLIT": splits, "SINKS": sinks, "GATE": gate, "BG": _pow2(g, 16), "BD": _pow2(d, 16),
              "BDV": _pow2(d, 16), "BN": BLOCK_N, "MMA": cache != "fp32" if mma is None else mma}
    return name, attention_kernel, _signature(attention_kernel, types, consts), consts


def ptx_options(case: tuple) -> dict:
    """triton.compile's options for a ptx_cases() entry as its wrapper launches it (num_warps)."""
    return {"num_warps": 8 if case[1] is attention_kernel and not case[3]["MMA"] else 4}


def ptx_cases() -> list[tuple]:
    """(name, jit function, signature, constexprs) of each launch the GPU decode path makes for Qwen3-30B-A3B
    (32 q / 4 kv heads of 128, head-wise qk norm, neox) and gpt-oss-20b (64 q / 8 kv heads of 64, sinks,
    a 128-position window on alternate layers over a ring of 10 blocks of 16), caches in bf16 and float32."""
    cases = []
    for cache in ("bf16", "fp32"):
        cases += [
            _rope_case(f"a3b_qk_rope_{cache}", 32, 4, 128, 128, True, True, False, cache),
            _rope_case(f"gptoss_qk_rope_{cache}", 64, 8, 64, 64, True, False, False, cache),
            _attn_case(f"a3b_attention_{cache}", 32, 4, 128, 1, 4096, cache=cache),
            _attn_case(f"a3b_attention_split_{cache}", 32, 4, 128, 64, 512, cache=cache),
            _attn_case(f"gptoss_attention_split_{cache}", 64, 8, 64, 32, 1024, sinks=True, cache=cache),
            _attn_case(f"gptoss_attention_window_{cache}", 64, 8, 64, 1, 128, ring=10, window=128, sinks=True,
                       cache=cache),
        ]
    cases.append(_rope_case("qwen35_qk_rope_gate_partial", 16, 2, 256, 64, True, True, True))
    cases.append(_attn_case("qwen35_attention_gate", 16, 2, 256, 8, 512, gate=True))
    return cases
