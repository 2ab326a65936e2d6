"""The decode step's non-GEMM kernels in Triton, one launch each, for CUDA graph capture.

    qk_rope_kv_write, decode_attention          (moerun.kernels.triton_attn, re-exported here)
    route(logits, k, ids_out, w_out, ...)       moerun.model.moe.route's choice and weights
    embed_rows(tokens, table, out)              dequantized embedding rows (GGUF blocks or floats)
    rms_norm(x, w, eps, out)                    out = w * normalise(x)
    add_rms_norm(x, delta, w, eps, out)         x += delta in place, then out = w * normalise(x)

(argmax: torch.argmax is one launch on CUDA.) Every input is on the device and every grid comes from
shapes: no host synchronisation, nothing allocated when output buffers are given. Launches go through
moerun.device.launch. Kernels use triton builtins and the library's combine functions only (see triton_q);
the module is built under the TRITON_INTERPRET of its import (INTERPRETED), and triton_dequant is rebuilt
under it when it was built under the other.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
import triton
import triton.language as tl

from moerun import device
from moerun.kernels import triton_attn
from moerun.kernels import triton_dequant as _dq
from moerun.kernels.triton_attn import (
    attention_splits,
    attention_workspace,
    decode_attention,
    qk_rope_kv_write,
)
from moerun.quant.qtypes import FLOAT_QTYPES, QType, block_size, row_bytes

__all__ = ["EMBED_QTYPES", "add_rms_norm", "attention_splits", "attention_workspace", "decode_attention",
           "embed_rows", "ptx_cases", "ptx_options", "qk_rope_kv_write", "rms_norm", "route"]

INTERPRETED = bool(triton.knobs.runtime.interpret)
if _dq.INTERPRETED != INTERPRETED:
    _dq = importlib.reload(_dq)
dq_tile = _dq.dq_tile
SPANS = "SP" in inspect.signature(dq_tile.fn).parameters  # dq_tile(.., BK, SP, ALIGNED): tiles read as spans

QUANTIZED = (QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, QType.MXFP4)
EMBED_QTYPES = frozenset(QUANTIZED) | frozenset(FLOAT_QTYPES)
MODES = {"softmax": 0, "topk_softmax": 1, "sigmoid": 2}
_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@triton.jit
def _max2(x):
    return tl.reduce(tl.reduce(x, 1, tl.standard._elementwise_max), 0, tl.standard._elementwise_max)


@triton.jit
def _min2(x):
    return tl.reduce(tl.reduce(x, 1, tl.standard._elementwise_min), 0, tl.standard._elementwise_min)


@triton.jit
def _sum2(x):
    return tl.reduce(tl.reduce(x, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)


@triton.jit
def route_kernel(logit_ptr, stride_l, bias_ptr, sbias_ptr, ids_ptr, stride_ids, w_ptr, stride_w, routed_scale,
                 E: tl.constexpr, K: tl.constexpr, MODE: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                 SBIAS: tl.constexpr, NG: tl.constexpr, TG: tl.constexpr, TOP2: tl.constexpr,
                 BGR: tl.constexpr, BEG: tl.constexpr, BK: tl.constexpr):
    """Grid (B,): row b's experts as a [BGR groups, BEG per group] tile (one group unless NG > 1)."""
    b = tl.program_id(0)
    EG: tl.constexpr = E // NG
    r = tl.arange(0, BGR)
    c = tl.arange(0, BEG)
    valid = (r[:, None] < NG) & (c[None, :] < EG)
    e = r[:, None] * EG + c[None, :]  # [BGR, BEG] expert ids
    key = tl.where(valid, e, E)
    x = tl.load(logit_ptr + b.to(tl.int64) * stride_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    if BIAS:
        x = x + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    if MODE == 0:
        ex = tl.exp(x - _max2(x))
        scores = ex / _sum2(ex)
    elif MODE == 2:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        scores = x
    choice = scores
    if SBIAS:
        choice = choice + tl.load(sbias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if NG > 1:
        best = tl.reduce(choice, 1, tl.standard._elementwise_max)  # [BGR]
        gs = best
        if TOP2:
            at = tl.where(choice == best[:, None], c[None, :], BEG)
            first = tl.reduce(at, 1, tl.standard._elementwise_min)
            rest = tl.where(c[None, :] == first[:, None], float("-inf"), choice)
            gs = best + tl.reduce(rest, 1, tl.standard._elementwise_max)
        gs = tl.where(r < NG, gs, float("-inf"))
        keep = r < 0
        for _ in tl.static_range(TG):
            top = tl.reduce(gs, 0, tl.standard._elementwise_max)
            gi = tl.reduce(tl.where(gs == top, r, BGR), 0, tl.standard._elementwise_min)
            keep = keep | (r == gi)
            gs = tl.where(r == gi, float("-inf"), gs)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    kk = tl.arange(0, BK)
    ids = tl.full((BK,), 0, tl.int32)
    w = tl.full((BK,), 0.0, tl.float32)
    for t in tl.static_range(K):
        top = _max2(choice)
        idx = _min2(tl.where(choice == top, key, E))
        sel = key == idx
        ids = tl.where(kk == t, idx, ids)
        w = tl.where(kk == t, _sum2(tl.where(sel, scores, 0.0)), w)
        choice = tl.where(sel, float("-inf"), choice)
    kmask = kk < K
    if MODE == 1:
        ex = tl.where(kmask, tl.exp(w - tl.reduce(tl.where(kmask, w, float("-inf")), 0,
                                                 tl.standard._elementwise_max)), 0.0)
        w = ex / tl.reduce(ex, 0, tl.standard._sum_combine)
    elif NORM:
        total = tl.reduce(tl.where(kmask, w, 0.0), 0, tl.standard._sum_combine)
        if MODE == 2:
            total = total + 1e-20
        w = w / total
    w = w * routed_scale
    tl.store(ids_ptr + b.to(tl.int64) * stride_ids + kk, ids.to(ids_ptr.dtype.element_ty), mask=kmask)
    tl.store(w_ptr + b.to(tl.int64) * stride_w + kk, w.to(w_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def embed_kernel(tok_ptr, w_ptr, kv_ptr, out_ptr, stride_out, B, V, H, row_bytes,
                 QTYPE: tl.constexpr, FLOAT: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
                 SP: tl.constexpr, ALIGNED: tl.constexpr):
    """Grid (cdiv(B, BB), cdiv(H, BK)): out rows of tokens [BB] (out of [0, V): zeros), columns k0..k0+BK."""
    rows = tl.program_id(0) * BB + tl.arange(0, BB)
    k0 = tl.program_id(1) * BK
    tok = tl.load(tok_ptr + rows, mask=rows < B, other=0).to(tl.int64)
    rmask = (rows < B) & (tok >= 0) & (tok < V)
    k = k0 + tl.arange(0, BK)[None, :]  # [1, BK]
    if FLOAT:
        w = tl.load(w_ptr + tok[:, None] * H + k, mask=rmask[:, None] & (k < H), other=0.0).to(tl.float32)
    elif SP == 0:
        w = dq_tile(w_ptr, tok * row_bytes, rmask, k0, H, kv_ptr, QTYPE, BK)  # [BB, BK]
    else:
        w = dq_tile(w_ptr, tok * row_bytes, rmask, k0, H, kv_ptr, QTYPE, BK, SP, ALIGNED)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + k, w.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < B) & (k < H))


@triton.jit
def rms_norm_kernel(x_ptr, stride_x, d_ptr, stride_d, w_ptr, out_ptr, stride_out, eps, H: tl.constexpr,
                    ADD: tl.constexpr, BH: tl.constexpr):
    """Grid (B,): row b (ADD: x += delta stored first) normed into out."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)
    m = h < H
    x = tl.load(x_ptr + b * stride_x + h, mask=m, other=0.0)
    if ADD:
        delta = tl.load(d_ptr + b * stride_d + h, mask=m, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + delta).to(x.dtype)
        tl.store(x_ptr + b * stride_x + h, x, mask=m)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.reduce(xf * xf, 0, tl.standard._sum_combine) / H + eps)
    y = (xf * r).to(x.dtype).to(tl.float32) * tl.load(w_ptr + h, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_out + h, y.to(out_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------ wrappers


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def route(logits, k: int, ids_out, w_out, *, mode: str = "softmax", norm_topk: bool = False,
          routed_scale: float = 1.0, score_bias=None, logit_bias=None, n_groups: int = 1,
          topk_groups: int = 1, group_score: str = "max"):
    """One launch: each row's k experts (ids_out [B, k] int32, descending choice, ties to the lower id) and
    weights (w_out [B, k] float32) from router logits [B, E], as moerun.model.moe.route (spec.router = mode,
    spec.norm_topk, spec.routed_scale, spec.n_groups / topk_groups / group_score; score_bias = lw.score_b,
    which ranks only; logit_bias = lw.router_b, added to the logits first). Returns (ids_out, w_out)."""
    b, e = logits.shape
    if mode not in MODES or group_score not in ("max", "top2"):
        raise ValueError(f"mode {mode!r} / group_score {group_score!r}: one of {sorted(MODES)} / max, top2")
    if e % n_groups or not 1 <= topk_groups <= n_groups or not 1 <= k <= e or logits.stride(1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} (contiguous rows), k {k}, groups {n_groups} / "
                         f"{topk_groups} do not fit")
    if tuple(ids_out.shape) != (b, k) or tuple(w_out.shape) != (b, k) or ids_out.stride(1) != 1 or \
            w_out.stride(1) != 1:
        raise ValueError(f"ids_out and w_out must be [{b}, {k}] with contiguous rows")
    if b == 0:
        return ids_out, w_out
    groups = n_groups if mode != "topk_softmax" else 1
    device.launch(route_kernel, (b,), logits, logits.stride(0),
                  logit_bias if logit_bias is not None else logits,
                  score_bias if score_bias is not None else logits, ids_out, ids_out.stride(0), w_out,
                  w_out.stride(0), float(routed_scale), E=e, K=k, MODE=MODES[mode], NORM=bool(norm_topk),
                  BIAS=logit_bias is not None, SBIAS=score_bias is not None and mode != "topk_softmax",
                  NG=groups, TG=topk_groups if groups > 1 else 1, TOP2=group_score == "top2",
                  BGR=_pow2(groups), BEG=_pow2(e // groups), BK=_pow2(k), num_warps=4)
    return ids_out, w_out


@functools.cache
def _codebook(qtype: QType, dev: torch.device) -> torch.Tensor:
    from moerun.quant.dequant import KV_IQ4NL, KV_MXFP4

    return {QType.MXFP4: KV_MXFP4}.get(qtype, KV_IQ4NL).to(dev)


def embed_tile(b: int, qtype) -> dict:
    """embed_kernel's tile constexprs for a batch of b: rows BB, columns BK, dq_tile's span SP (0: the
    dq_tile without spans, or floats)."""
    qtype = QType(qtype)
    if qtype in FLOAT_QTYPES:
        return {"BB": min(_pow2(b), 16), "BK": 512, "SP": 0}
    elems, nbytes = block_size(qtype)
    bk = 512 if elems == 256 else 256  # a span of at least 16 bytes a thread in one warp
    return {"BB": min(_pow2(b), 4), "BK": bk, "SP": _pow2(15 + bk // elems * nbytes) if SPANS else 0}


def embed_warps(tile: dict) -> int:
    """Warps of an embedding launch: 16 bytes of each row's span per thread where the tile allows."""
    return max(1, min(8, tile["BB"] * tile["SP"] // 512)) if tile["SP"] else 4


def embed_rows(tokens, table, out, codebook=None):
    """One launch: out [B, H] = rows tokens [B] (int32/int64) of table (QTensor-like: .data uint8 [V, row
    bytes], .qtype one of EMBED_QTYPES, .shape (V, H)), dequantized as moerun.quant.dequant does (a token
    outside [0, V) gives zeros). codebook: IQ4_XS / MXFP4's 16 floats on the device (cached per device by
    default: pass it to allocate nothing on a first call). Returns out."""
    qtype = QType(table.qtype)
    v, h = table.shape
    if qtype not in EMBED_QTYPES:
        raise ValueError(f"no Triton embedding rows for {qtype.name}")
    if tuple(out.shape) != (tokens.shape[0], h) or out.stride(1) != 1 or not table.data.is_contiguous():
        raise ValueError(f"out must be [{tokens.shape[0]}, {h}] with contiguous rows, the table contiguous")
    b = tokens.shape[0]
    if b == 0:
        return out
    tile = embed_tile(b, qtype)
    flt = qtype in FLOAT_QTYPES
    w = table.data.view(FLOAT_QTYPES[qtype]) if flt else table.data
    if codebook is None:
        codebook = _codebook(qtype, table.data.device) if qtype in (QType.IQ4_XS, QType.MXFP4) else out
    device.launch(embed_kernel, (_cdiv(b, tile["BB"]), _cdiv(h, tile["BK"])), tokens, w, codebook, out,
                  out.stride(0), b, v, h, row_bytes(qtype, h), QTYPE=int(qtype), FLOAT=flt,
                  ALIGNED=w.data_ptr() % 16 == 0, num_warps=embed_warps(tile), **tile)
    return out


def _norm(x, delta, w, eps, out, add):
    b, h = x.shape
    if x.stride(1) != 1 or tuple(out.shape) != (b, h) or out.stride(1) != 1 or w.shape != (h,):
        raise ValueError(f"x, out [{b}, {h}] with contiguous rows and w [{h}] expected")
    if h > 16384:
        raise ValueError(f"rows of {h} exceed the one-tile norm (16384)")
    if b:
        device.launch(rms_norm_kernel, (b,), x, x.stride(0), delta, delta.stride(0), w, out, out.stride(0),
                      float(eps), H=h, ADD=add, BH=_pow2(h), num_warps=4 if h <= 4096 else 8)
    return out


def rms_norm(x, w, eps: float, out):
    """One launch: out [B, H] = w * (x * rsqrt(mean(x^2) + eps)), normalised in float32 and rounded to x's
    dtype before the weight (moerun.model.layers.rms_norm). Returns out."""
    return _norm(x, x, w, eps, out, False)


def add_rms_norm(x, delta, w, eps: float, out):
    """One launch: x += delta (in place, x's dtype), then out = rms_norm(x, w, eps). Returns out."""
    if delta.shape != x.shape or delta.stride(1) != 1:
        raise ValueError(f"delta {tuple(delta.shape)} must be x's shape {tuple(x.shape)}, rows contiguous")
    return _norm(x, delta, w, eps, out, True)


# ------------------------------------------------------------------------------------------ compile cases


def _route_case(name, e, k, mode, norm, bias=False, sbias=False, ng=1, tg=1, top2=False):
    types = {"logit_ptr": "*fp32", "stride_l": "i32", "bias_ptr": "*fp32", "sbias_ptr": "*fp32",
             "ids_ptr": "*i32", "stride_ids": "i32", "w_ptr": "*fp32", "stride_w": "i32",
             "routed_scale": "fp32"}
    consts = {"E": e, "K": k, "MODE": MODES[mode], "NORM": norm, "BIAS": bias, "SBIAS": sbias, "NG": ng,
              "TG": tg, "TOP2": top2, "BGR": _pow2(ng), "BEG": _pow2(e // ng), "BK": _pow2(k)}
    return name, route_kernel, triton_attn._signature(route_kernel, types, consts), consts


def _embed_case(name, qtype, b, out="fp32"):
    flt = qtype in FLOAT_QTYPES
    types = {"tok_ptr": "*i32", "w_ptr": f"*{_TL[FLOAT_QTYPES[qtype]]}" if flt else "*u8", "kv_ptr": "*fp32",
             "out_ptr": f"*{out}", **dict.fromkeys(("stride_out", "B", "V", "H", "row_bytes"), "i32")}
    consts = {"QTYPE": int(qtype), "FLOAT": flt, "ALIGNED": True, **embed_tile(b, qtype)}
    return name, embed_kernel, triton_attn._signature(embed_kernel, types, consts), consts


def _norm_case(name, h, add, act="fp32"):
    types = {"x_ptr": f"*{act}", "stride_x": "i32", "d_ptr": f"*{act}", "stride_d": "i32", "w_ptr": f"*{act}",
             "out_ptr": f"*{act}", "stride_out": "i32", "eps": "fp32"}
    consts = {"H": h, "ADD": add, "BH": _pow2(h)}
    return name, rms_norm_kernel, triton_attn._signature(rms_norm_kernel, types, consts), consts


def ptx_options(case: tuple) -> dict:
    """triton.compile's options for a ptx_cases() entry as its wrapper launches it."""
    if case[1] is embed_kernel:
        return {"num_warps": embed_warps(case[3])}
    return {"num_warps": 8 if case[1] is rms_norm_kernel and case[3]["H"] > 4096 else 4}


def ptx_cases() -> list[tuple]:
    """(name, jit function, signature, constexprs) of this module's launches on the GPU decode path for
    Qwen3-30B-A3B (hidden 2048, 128 experts top-8 softmax norm_topk, vocab 151936, Q4_K / Q6_K / Q8_0
    embeddings) and gpt-oss-20b (hidden 2880, 32 experts top-4 topk_softmax with the router's bias), with
    a DeepSeek-V3-style grouped sigmoid router; triton_attn.ptx_cases() has the attention launches."""
    cases = [
        _route_case("a3b_route", 128, 8, "softmax", True),
        _route_case("gptoss_route", 32, 4, "topk_softmax", False, bias=True),
        _route_case("dsv3_route", 256, 8, "sigmoid", True, sbias=True, ng=8, tg=4, top2=True),
    ]
    for qtype in (QType.Q4_K, QType.Q6_K, QType.Q8_0):
        cases += [_embed_case(f"a3b_embed_{qtype.name}_b{b}", qtype, b) for b in (1, 16)]
    cases += [_embed_case(f"gptoss_embed_{q.name}", q, 8) for q in (QType.Q8_0, QType.BF16, QType.F32)]
    for name, h in (("a3b", 2048), ("gptoss", 2880)):
        cases += [_norm_case(f"{name}_rms_norm", h, False), _norm_case(f"{name}_add_rms_norm", h, True),
                  _norm_case(f"{name}_add_rms_norm_bf16", h, True, "bf16")]
    return cases
