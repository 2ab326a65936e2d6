"""Triton GPU kernels that read GGUF blocks as stored, dequantizing in registers.

    from moerun.kernels import triton_q
    if triton_q.available() and triton_q.supports(w.qtype):
        y = triton_q.matmul(x, w)                        # x [T, K] float @ w QTensor [N, K]^T -> [T, N]
        y = triton_q.matmul(x, w, norm=(nw, eps), bias=b) # (rms_norm(x) * nw) @ w^T + b, one launch
        triton_q.matmul(x, wo, out=resid, accumulate=True)  # resid += x @ wo^T, one launch
        y = triton_q.matmul_multi(x, [wq, wk, wv])       # [T, Nq + Nk + Nv], one launch per 3 weights
        y = triton_q.swiglu(x, gate, up, down)           # down(silu(gate x) * up x) -> [T, H], two launches
        y = triton_q.moe_ffn(x, ids, weights, experts)   # {e: Expert}: ReferenceOps.moe -> [T, H]

Weights (QTensor.data, uint8) and activations must be on the same device: CUDA, or the CPU when
TRITON_INTERPRET=1 (triton's interpreter, how the tests run without a GPU). Activations are not
quantized: every product and sum is float32, so results match x @ w.dequantize().T to float32
accumulation error. Results come back in x's dtype. Every launch goes through moerun.device.launch.

moe_ffn, up to 16 tokens: two launches, nothing sorted or counted (triton_moe_decode): gate and up with
the activation per (token, choice) pair, then down scaled by the routing weight with each token's k
choices added in choice order (+ into `out`). More tokens: the pairs are sorted by expert on the device
(argsort, counts by scatter_add; no count comes back to the host), two grouped launches (triton_moe) and
one that adds each token's rows in choice order. ExpertFn's gpt-oss activation and biases are computed
in the kernels. ReferenceOps.moe adds experts in id order: the results differ by float32 rounding only.

Tiles: a decode step's GEMV (one row) takes BN rows of the weight per program, BN chosen so a launch has
at least PROGRAMS_MIN programs (4 per SM of a 132-SM H200): decode_programs() says how many. warmup()
compiles what a placed model launches; ptx_cases() lists those launches for tests/test_triton_ptx.py.

This module imports without triton (available() is then False); triton is imported, and the kernels
are built, at the first call, reading TRITON_INTERPRET then (and rebuilding if it has changed).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from moerun.quant.dequant import KV_IQ4NL, KV_MXFP4
from moerun.quant.qtypes import QTensor, QType, block_size, row_bytes

__all__ = ["SUPPORTED", "ExpertTable", "Launch", "available", "decode_programs", "dequantize", "join_biases",
           "matmul", "matmul_multi", "moe_ffn", "supports", "swiglu", "warmup"]

SUPPORTED = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, QType.MXFP4})
CODEBOOKS = {QType.IQ4_XS: KV_IQ4NL, QType.MXFP4: KV_MXFP4}
ACTS = {"swiglu": 0, "swiglu_oai": 1}
PAIRS_MAX = 16  # tokens up to which moe_ffn runs pair by pair, unsorted
PROGRAMS_MIN = 4 * 132  # programs a decode launch should have: 4 per SM of an H200


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (TRITON_INTERPRET, read now)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def _triton_error() -> str | None:
    try:
        import triton.language  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:  # absent, or a broken install
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """triton imports, and kernels have somewhere to run: a CUDA device, or TRITON_INTERPRET=1."""
    from moerun.device import cuda_available

    if not (interpreting() or cuda_available()):
        return False
    return _triton_error() is None


def supports(qtype) -> bool:
    """Whether the kernels read this ggml type (whatever available() says)."""
    try:
        return QType(qtype) in SUPPORTED
    except ValueError:
        return False


def runs_on(device: torch.device) -> bool:
    """Whether tensors on `device` can go to the kernels now: CUDA compiled, or the CPU interpreted."""
    return available() and device.type == ("cpu" if interpreting() else "cuda")


_modules: dict[str, object] = {}


def _kernels():
    """(dequant, grouped GEMM, pair MoE) kernel modules, (re)imported when absent or built under another
    TRITON_INTERPRET (the two others hold dequant's dq_tile: they are rebuilt with it)."""
    if _triton_error() is not None:
        raise RuntimeError(f"triton unavailable: {_triton_error()}")
    mode = interpreting()
    mods = [_modules.get(n) or importlib.import_module(f"moerun.kernels.{n}")
            for n in ("triton_dequant", "triton_moe", "triton_moe_decode")]
    stale = next((i for i, m in enumerate(mods) if m.INTERPRETED != mode), None)
    if stale is not None:
        mods = mods[:stale] + [importlib.reload(m) for m in mods[stale:]]
    _modules.update(zip(("triton_dequant", "triton_moe", "triton_moe_decode"), mods))
    return mods


def _launch(kernel, grid, *args) -> None:
    """device.launch(kernel, grid, *args[:-1], **args[-1]): the kernels' constexprs come last, as a dict."""
    from moerun import device

    device.launch(kernel, grid, *args[:-1], **args[-1])


@functools.cache
def _codebook(qtype: QType, device: torch.device) -> torch.Tensor:
    return CODEBOOKS.get(qtype, KV_IQ4NL).to(device)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------ tiles

# rows per tile (a power of two) -> (BM, BN, num_warps in the interpreter; _warps on a GPU); None: a GEMV
# whose BN gemv_bn chooses. Weights are read in tiles of BK = 256 elements (fewer for short rows); from 4
# rows tl.dot (float32, ieee) on 16 x 16 tiles. Checked with ptxas (cuobjdump -res-usage, sm_90): decode
# GEMVs take up to 255 registers with at most 224 bytes of stack; the tl.dot tiles spill 0.2-1 KB (32 x 32
# tiles spilled 3-12 KB).
TILES = {1: None, 2: (2, 4, 2), 4: (16, 16, 8), 8: (16, 16, 8), 16: (16, 16, 8), 32: (16, 16, 8)}
GEMV_BN_MAX = 8  # 16 rows of spans and their gathers spill registers (Q8_0: 1.8 KB of stack)
DOT_STAGES = 2  # tl.dot tiles' software pipeline: 3 stages of spans take up to 250 KB of shared memory
# The interpreter's cost is per program and per operation, not per element: fewer, larger tiles.
INTERPRETER_TILES = {bm: (bm, 64, 4) for bm in TILES}


def gemv_bn(units: int) -> int:
    """Weight rows per GEMV program: the largest power of two up to GEMV_BN_MAX that leaves PROGRAMS_MIN
    programs for `units` rows of output (times the launch's independent tokens or pairs), at least 2 (2 rows' spans are
    512 bytes: a warp's 16-byte loads)."""
    bn = GEMV_BN_MAX
    while bn > 2 and units // bn < PROGRAMS_MIN:
        bn //= 2
    return bn


def _warps(bn: int, bm: int, sp: int) -> int:
    """Warps for a tile without tl.dot: each thread loads its rows' spans 16 bytes at a time."""
    return 8 if bm >= 16 else max(1, min(4, bn * sp // 512))


def _bk(qtypes, k: int) -> int:
    """Elements per weight tile: 256, a whole number of every type's blocks (fewer where K is short)."""
    qk = max(block_size(q)[0] for q in qtypes)
    return max(qk, min(256, _pow2(k)))


def _span(qtype: QType, bk: int) -> int:
    """dq_tile's SP: bytes read per row and tile, a tile's blocks from the 16-byte boundary before them."""
    qk, nbytes = block_size(qtype)
    return _pow2(15 + bk // qk * nbytes)


def _tiles(rows: int, units: int, k: int, *qtypes: QType, gpu: bool | None = None) -> dict:
    """Block sizes for about `rows` activation rows per tile; `units`: output rows a GEMV's grid covers.
    gpu: a GPU's sizes (default: unless interpreting)."""
    gpu = not interpreting() if gpu is None else gpu
    bm = min(32, _pow2(rows))
    entry = (TILES if gpu else INTERPRETER_TILES)[bm]
    bm, bn, warps = entry if entry is not None else (1, gemv_bn(units), 4)
    bk = _bk(qtypes, k)
    sp = _span(qtypes[0], bk)
    tiles = {"BM": bm, "BN": bn, "BK": bk, "SP": sp, "SP2": _span(qtypes[-1], bk), "USE_DOT": bm >= 16,
             "num_warps": _warps(bn, bm, sp) if gpu else warps}
    if bm >= 16 and gpu:
        tiles["num_stages"] = DOT_STAGES
    return tiles


def decode_programs(qtype, n: int, k: int, rows: int = 1, experts: int = 1, summed: bool = False) -> int:
    """Programs of the launch that computes `rows` tokens' products with an [n, k] weight: plain (experts 1),
    or the routed experts' pair launch (experts = the k choices per token: gate/up, or down with summed, one
    program per token over its choices), from the tile sizes the launch really takes."""
    qtype = QType(qtype)
    if experts > 1:
        units = rows * n if summed else rows * experts * n
        return (rows if summed else rows * experts) * _cdiv(n, _pair_tiles(units, k, qtype, gpu=True)["BN"])
    t = _tiles(rows, n, k, qtype, gpu=True)
    return _cdiv(rows, t["BM"]) * _cdiv(n, t["BN"])


def _pair_tiles(units: int, k: int, *qtypes: QType, gpu: bool | None = None) -> dict:
    bk = _bk(qtypes, k)
    gpu = not interpreting() if gpu is None else gpu
    bn, sp = gemv_bn(units) if gpu else 64, _span(qtypes[0], bk)
    return {"BN": bn, "BK": bk, "SP": sp, "SP2": _span(qtypes[-1], bk), "num_warps": _warps(bn, 1, sp)}


def _aligned(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


# ------------------------------------------------------------------------------------------ calls


def dequantize(w: QTensor) -> torch.Tensor:
    """w [N, K] -> float32 [N, K] on w's device (the kernels' dequantizer alone; for tests)."""
    _check_w(w, "w")
    if not runs_on(w.data.device):
        raise RuntimeError(f"Triton kernels cannot run on {w.data.device} now")
    dq, _, _ = _kernels()
    n, k = w.shape
    out = torch.empty((n, k), dtype=torch.float32, device=w.data.device)
    bn, bk = 32, _bk([w.qtype], k)
    _launch(dq.dequantize_kernel, (_cdiv(n, bn), _cdiv(k, bk)), w.data, out, _codebook(w.qtype, w.data.device), n, k,
            row_bytes(w.qtype, k), {"QTYPE": int(w.qtype), "BN": bn, "BK": bk, "SP": _span(w.qtype, bk),
                                        "ALIGNED": _aligned(w.data)})
    return out


def matmul(x: torch.Tensor, w: QTensor, *, norm: tuple[torch.Tensor, float] | None = None,
           bias: torch.Tensor | None = None, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """x [T, K] @ w[N, K]^T -> [T, N] in x.dtype (float32 inside), one launch. norm (nw [K], eps): x's rows
    RMS-normalised and times nw first. bias [N]: added. out: a float32 [T, N] tensor to write (returned);
    accumulate: out += the product (a residual)."""
    return matmul_multi(x, [w], norm=norm, biases=None if bias is None else [bias], out=out, accumulate=accumulate)


def join_biases(biases: list[torch.Tensor | None] | None, ns: list[int], dev) -> torch.Tensor | None:
    """[b1; b2; ...] float32 [sum N] as matmul_multi takes them (zeros for a None), or None for no bias at all."""
    if biases is not None and any(b is not None for b in biases):
        return torch.cat([torch.zeros(n, device=dev) if b is None else b.reshape(n).float() for b, n in zip(biases, ns)])


def matmul_multi(x: torch.Tensor, ws: list[QTensor], *, norm: tuple[torch.Tensor, float] | None = None,
                 biases: list[torch.Tensor | None] | None = None, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
    """x [T, K] @ [w1; w2; ...]^T -> [T, N1 + N2 + ...]: weights of one type and K (q|k|v, gate|up) side by
    side, one launch per three. norm, out, accumulate as matmul; biases: one [Ni] (or None) per weight, or one
    float32 [sum N] tensor (joined once by the caller: no launch here)."""
    if not ws:
        raise ValueError("ws is empty")
    for i, w in enumerate(ws):
        _check_w(w, f"ws[{i}]")
        if w.qtype != ws[0].qtype or w.shape[1] != ws[0].shape[1]:
            raise ValueError(f"ws[{i}] is {w.qtype.name}{w.shape}: the weights must share type and K")
    dev = ws[0].data.device
    _check_x(x, ws[0].shape[1], dev)
    x = x.contiguous()
    t, k = x.shape
    ns = [w.shape[0] for w in ws]
    total = sum(ns)
    given = out is not None
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out")
        out = torch.empty((t, total), dtype=torch.float32, device=dev)
    elif out.shape != (t, total) or out.dtype != torch.float32 or out.stride(1) != 1 or out.device != dev:
        raise ValueError(f"out must be float32 [{t}, {total}] with contiguous rows on {dev}")
    if norm is not None:
        norm = (norm[0].to(torch.float32).contiguous(), float(norm[1]))
    bias = None
    bias = biases if isinstance(biases, torch.Tensor) else join_biases(biases, ns, dev)
    if t:
        col = 0
        for i in range(0, len(ws), 3):
            part = ws[i:i + 3]
            width = sum(w.shape[0] for w in part)
            _qgemm(x, out[:, col:], t, [w.shape[0] for w in part], k, part[0].qtype, [w.data for w in part],
                   norm=norm, bias=None if bias is None else bias[col:col + width], accum=accumulate,
                   tiles=_tiles(t, width, k, part[0].qtype))
            col += width
    return out if given else out.to(x.dtype)


def swiglu(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, *,
           norm: tuple[torch.Tensor, float] | None = None, out: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """down(silu(gate x) * up x): x [T, H], gate/up [I, H], down [H, I] -> [T, H] in x.dtype, two launches.
    norm: x RMS-normalised first (as matmul); out / accumulate: as matmul, for the down product."""
    i, h = _check_ffn(gate, up, down)
    _check_x(x, h, gate.data.device)
    x = x.contiguous()
    t = x.shape[0]
    hid = torch.empty((t, i), dtype=torch.float32, device=x.device)  # [T, I]
    if t:
        if norm is not None:
            norm = (norm[0].to(torch.float32).contiguous(), float(norm[1]))
        _qgemm(x, hid, t, [i], h, gate.qtype, [gate.data, up.data], qtype2=up.qtype, gated=0, norm=norm,
               tiles=_tiles(t, i, h, gate.qtype, up.qtype))
    return matmul(hid, down, out=out, accumulate=accumulate) if out is not None else matmul(hid, down).to(x.dtype)


class ExpertTable:
    """What moe_ffn derives from an experts mapping before it can launch, checked once: their shared types
    and shapes (ValueError otherwise), the device tables of their weights (byte offsets from the first
    expert's gate) and ids, the id -> slot
    lookup. Build it once for experts that stay put (a layer's resident ones) and pass it to every call.
    Nothing is read back from the device (addresses are host metadata; the tables are uploaded)."""

    def __init__(self, experts: Mapping[int, object]):
        if not experts:
            raise ValueError("experts is empty")
        self.keys = sorted(experts)
        self.first = experts[self.keys[0]]
        self.dev = self.first.gate.data.device
        self.ffn = _check_ffn(self.first.gate, self.first.up, self.first.down)
        ptrs = _weight_addrs(experts, self.keys, self.first, self.dev)  # [3][slots]
        self.base = self.first.gate.data  # the kernels' weights: base + offset
        self.aligned = all(p % 16 == 0 for row in ptrs for p in row)
        offs = [[p - self.base.data_ptr() for p in row] for row in ptrs]
        self.addrs = _to_device(torch.tensor(offs, dtype=torch.int64), self.dev)  # [3, slots] byte offsets
        self.ids = _to_device(torch.tensor(self.keys, dtype=torch.int32), self.dev)  # [slots] slot -> id
        self.lut = _lut(self.keys, self.dev)


def moe_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Mapping[int, object],
            pairs: bool = False, table: ExpertTable | None = None, fn=None, out: torch.Tensor | None = None,
            accumulate: bool = False) -> torch.Tensor:
    """sum over each token's k choices of weights * expert(x), as ReferenceOps.moe: x [T, H], ids and
    weights [T, k] on the device, experts {id: Expert} sharing shapes and qtypes (ids without an entry add
    nothing). fn: ExpertFn (act "swiglu" or "swiglu_oai", biases [E, I], [E, I], [E, H] by id); None plain.
    Returns [T, H] in x.dtype, or with out (float32 [T, H]) out, += the result with accumulate; with
    `pairs`, [T * k, H] float32, one weighted row per (token, choice) pair (0 where the id has no entry),
    unsummed (ReferenceOps.moe_pairs)."""
    table = table or ExpertTable(experts)
    first, dev = table.first, table.dev
    i, h = table.ffn
    _check_x(x, h, dev)
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, k]")
    act, alpha, limit, biases = _fn_args(fn, dev)
    x = x.contiguous()
    t, kk = ids.shape
    m = t * kk
    given = out is not None
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out")
        if m == 0:
            return torch.zeros((0, h), dtype=torch.float32, device=dev) if pairs else torch.zeros_like(x)
    if m == 0:
        return out
    flat = ids.reshape(-1).contiguous()  # [T*k]
    scale = weights.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()  # [T*k]
    hid = torch.empty((m, i), dtype=torch.float32, device=dev)  # [T*k, I], row = pair
    y = None  # [T*k, H]: pair rows (zeros where sorted: pairs without an expert are in no tile)
    if pairs or t > PAIRS_MAX:
        y = (torch.empty if t <= PAIRS_MAX else torch.zeros)((m, h), dtype=torch.float32, device=dev)
    if out is None and not pairs:
        out = torch.empty((t, h), dtype=torch.float32, device=dev)
    qtypes = (first.gate.qtype, first.up.qtype, first.down.qtype)
    for launch in _moe_launches(x, flat, scale, table, qtypes, (i, h, t, kk), (act, alpha, limit, biases),
                                pairs, accumulate, hid, y, out):
        _launch(*launch)
    if pairs:
        return y
    return out if given else out.to(x.dtype)


def _moe_launches(x, flat, scale, table, qtypes, dims, fn_args, pairs, accumulate, hid, y, out) -> list[tuple]:
    """moe_ffn's launches, (kernel, grid, *args) with kwargs last: x [T, H], flat ids and scale [T*k], hid
    [T*k, I], y [T*k, H] (pairs, or sorted), out [T, H]; dims (I, H, T, k)."""
    (qg, qu, qd), (i, h, t, kk), (act, alpha, limit, biases) = qtypes, dims, fn_args
    dev, m, biased = x.device, t * kk, _biased(biases)
    if t > PAIRS_MAX:
        rows = max(1, m // len(table.keys))
        tu, td = _tiles(rows, i, h, qg, qu), _tiles(rows, h, i, qd)
        pair, (tab_u, _), (tab_d, _) = _schedule(flat, table.keys, table.lut, tu, td)
        grouped = {"keys": table.ids, "aligned": table.aligned, "bias": biases[0] if biased else None}
        res = [_qgemm_launch(x, hid, m, [i], h, qg, [*table.addrs[:2], table.base], qtype2=qu, gated=act, alpha=alpha,
                             limit=limit, grouped=(pair, kk, tab_u), bias2=biases[1], tiles=tu, **grouped)]
        grouped["bias"] = biases[2] if biased else None
        res.append(_qgemm_launch(hid, y, m, [h], i, qd, [table.addrs[2], table.base], grouped=(pair, 1, tab_d), scale=scale,
                                 tiles=td, **grouped))
        if not pairs:
            _, gm, _ = _kernels()
            res.append((gm.sum_pairs_kernel, (t, _cdiv(h, 1024)), (y, out, out.stride(0), h, kk),
                        {"ACCUM": accumulate, "BH": 1024}))
        return [(k, g, *a, kw) for k, g, a, kw in res]
    _, _, md = _kernels()
    common = (flat, scale, table.lut, table.lut.shape[0], len(table.keys), table.base)
    tu = _pair_tiles(m * i, h, qg, qu)
    dst, rows = (y, m) if pairs else (out, t)
    td = _pair_tiles(rows * h, i, qd)
    opts = {"ACT": act, "BIAS": biased, "ALIGNED": table.aligned}
    return [
        (md.moe_pair_kernel, (m, _cdiv(i, tu["BN"])), x, x.stride(0), hid, hid.stride(0), *common, table.addrs[0],
         table.addrs[1], row_bytes(qg, h), row_bytes(qu, h), _codebook(qg, dev), _codebook(qu, dev), biases[0],
         biases[1], alpha, limit, i, h, kk,
         dict(QTYPE=int(qg), QTYPE2=int(qu), GATED=True, SUM=False, ACCUM=False, **opts, **tu)),
        (md.moe_pair_kernel, (rows, _cdiv(h, td["BN"])), hid, hid.stride(0), dst, dst.stride(0), *common,
         table.addrs[2], table.addrs[2], row_bytes(qd, i), row_bytes(qd, i), _codebook(qd, dev), _codebook(qd, dev),
         biases[2], biases[2], alpha, limit, h, i, kk,
         dict(QTYPE=int(qd), QTYPE2=int(qd), GATED=False, SUM=not pairs, ACCUM=accumulate and not pairs, **opts,
              **td)),
    ]


def _biased(biases) -> bool:
    """Whether _fn_args found biases (else every entry is the placeholder)."""
    return biases[0] is not biases[3]


def _fn_args(fn, dev: torch.device):
    """(ACT, alpha, limit, (gate, up, down biases float32 on dev, or a placeholder; the placeholder))."""
    dummy = _codebook(QType.IQ4_XS, dev)
    if fn is None:
        return 0, 1.0, 0.0, (dummy, dummy, dummy, dummy)
    if fn.act not in ACTS:
        raise ValueError(f"no Triton kernel for the expert activation {fn.act!r}")
    b = (dummy,) * 3 if fn.biases is None else tuple(v.to(device=dev, dtype=torch.float32).contiguous()
                                                     for v in fn.biases)
    return ACTS[fn.act], float(fn.alpha), float(fn.limit), (*b, dummy)


# --------------------------------------------------------------------------------------- launches


def _qgemm_launch(a, out, m, ns, k, qtype, ws, *, tiles, qtype2=None, gated=None, alpha=1.0, limit=0.0,
                  grouped=None, keys=None, aligned=None, scale=None, norm=None, bias=None, bias2=None,
                  accum=False):
    """(kernel, grid, args, kwargs) of one qgemm_kernel launch. ns: the output widths of ws (up to three side
    by side; with gated (ACT), ws = [gate, up]). grouped: (pair [T*k] int32, a_div, tile table [U, 3]
    int32), ws the int64 address tables of gate (and up) per slot, keys the slot -> id table; else plain
    on ws' bytes (uint8 tensors)."""
    _, gm, _ = _kernels()
    dev = a.device
    tiles = dict(tiles)
    qtype2 = qtype if qtype2 is None else qtype2
    segs = 1 if gated is not None or grouped is not None else len(ws)
    wa, wb, wc = ws[0], ws[min(1, len(ws) - 1)], ws[-1]
    if grouped is not None:  # ws: gate (and up) offset tables, then the base
        wa, wb = ws[0], ws[-2]
    if grouped is None:
        pair, a_div, table = out, 1, out  # unused placeholders
        grid_m = _cdiv(m, tiles["BM"])
        aligned = _aligned(*ws) if aligned is None else aligned
    else:
        pair, a_div, table = grouped
        grid_m = table.shape[0]
    n_all = list(ns) + [0] * (3 - len(ns))
    grid_n = sum(_cdiv(n, tiles["BN"]) for n in ns[:segs])
    nw, eps = norm if norm is not None else (out, 0.0)
    args = (a, a.stride(0), out, out.stride(0), pair, a_div, out if scale is None else scale, table,
            out if keys is None else keys, wa, wb, wc, row_bytes(qtype, k), row_bytes(qtype2, k),
            _codebook(qtype, dev), _codebook(qtype2, dev), out if bias is None else bias,
            out if bias2 is None else bias2, nw, eps, alpha, limit, m, *n_all, k)
    kwargs = dict(QTYPE=int(qtype), QTYPE2=int(qtype2), GROUPED=grouped is not None, GATED=gated is not None,
                  ACT=gated or 0, SCALED=scale is not None, NORM=norm is not None, BIAS=bias is not None,
                  ACCUM=accum, SEGS=segs, ALIGNED=bool(aligned), **tiles)
    return gm.qgemm_kernel, (grid_m, grid_n), args, kwargs


def _qgemm(*args, **kwargs) -> None:
    kernel, grid, a, kw = _qgemm_launch(*args, **kwargs)
    _launch(kernel, grid, *a, kw)


def _weight_addrs(experts: Mapping[int, object], keys: list[int], first, dev: torch.device) -> list[list[int]]:
    """[3][slots]: the gate, up and down data addresses of the experts in ascending id order."""
    like = [(q.qtype, q.shape) for q in (first.gate, first.up, first.down)]
    addrs = []
    for name, (qtype, shape) in zip(("gate", "up", "down"), like):
        row = []
        for e in keys:
            q = getattr(experts[e], name, None)
            if not isinstance(q, QTensor) or q.qtype != qtype or q.shape != shape:
                raise ValueError(f"experts[{e}].{name} is not a {qtype.name}{shape} QTensor like experts[{keys[0]}]")
            if q.data.device != dev or not q.data.is_contiguous():
                raise ValueError(f"experts[{e}].{name}.data must be contiguous on {dev}")
            row.append(q.data.data_ptr())
        addrs.append(row)
    return addrs


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on dev; to a GPU through pinned memory, so the copy does not wait for the GPU."""
    from moerun.device import upload

    return upload(t, dev)


def _lut(keys: list[int], dev: torch.device) -> torch.Tensor:
    """expert id -> its slot among the sorted keys, len(keys) for none; ids up to keys[-1] + 1, on dev."""
    lut = torch.full((keys[-1] + 2,), len(keys), dtype=torch.int32)
    lut[keys] = torch.arange(len(keys), dtype=torch.int32)
    return _to_device(lut, dev)


def _schedule(ids: torch.Tensor, keys: list[int], lut: torch.Tensor, *tile_sizes: dict):
    """Sort the T*k pairs by expert slot and cut each slot's run into tiles, on the device.

    Returns pair [T*k] int32 (pair indices, sorted by slot; pairs whose id has no expert last, in no
    tile) and, per entry of tile_sizes, (tile table [U, 3] int32, the sizes). U is the bound
    cdiv(T*k, BM) + slots, so no count comes back to the host; spare tiles have slot -1. Counts are a
    scatter_add (a bin count reads its range back to the host on CUDA).
    """
    dev = ids.device
    n = len(keys)
    flat = ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat <= keys[-1]), flat, keys[-1] + 1)
    slot = lut[flat].to(torch.int64)  # [T*k], n = no expert
    pair = torch.argsort(slot, stable=True)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=dev).scatter_add_(0, slot, torch.ones_like(slot))[:n]
    starts = torch.cumsum(counts, 0) - counts
    out = [pair.to(torch.int32)]
    for sizes in tile_sizes:
        bm = sizes["BM"]
        per = (counts + bm - 1) // bm
        ends = torch.cumsum(per, 0)  # [slots]
        u = torch.arange(_cdiv(slot.numel(), bm) + n, device=dev)  # [U]
        s = torch.searchsorted(ends, u, right=True)
        sc = s.clamp(max=n - 1)
        r0 = starts[sc] + (u - (ends[sc] - per[sc])) * bm
        r1 = torch.minimum(r0 + bm, starts[sc] + counts[sc])
        table = torch.stack([torch.where(s < n, s, -1), r0, r1], 1).to(torch.int32).contiguous()
        out.append((table, sizes))
    return out


# ------------------------------------------------------------------------------- warmup, PTX cases


class Launch(NamedTuple):
    """A call a placed model makes, for warmup() and ptx_cases(). op "matmul": qtypes (w,), n the output
    width or the widths side by side (matmul_multi), k; options "norm", "bias", "accumulate". op "swiglu":
    qtypes (gate, up, down), n = I, k = H; options "norm", "accumulate". op "moe": qtypes (gate, up, down),
    n = I, k = H, choices per token, slots (experts in the table); options "oai" (gpt-oss's activation),
    "bias", "pairs", "accumulate". rows: tokens per call (the row bucket)."""

    op: str
    qtypes: tuple
    n: int | tuple
    k: int
    rows: int = 1
    options: frozenset = frozenset()
    choices: int = 8
    slots: int = 128


def warmup(configs: Iterable[Launch], device: torch.device | str = "cuda") -> int:
    """Compiles, without running, the kernels the calls `configs` make on `device` (a placed model's shapes,
    each row bucket it will see), so that a first request does not wait for triton. Returns the number of
    launch configurations compiled; 0 (nothing to do) in the interpreter or without triton."""
    dev = torch.device(device)
    if interpreting() or not runs_on(dev):
        return 0
    _, gm, _ = _kernels()
    n = 0
    for c in configs:
        for kernel, grid, *args in gm.config_launches(c, dev):
            kernel.warmup(*args[:-1], grid=grid, **args[-1])
            n += 1
    return n


# ------------------------------------------------------------------------------------------ checks


def _check_w(w, name: str) -> None:
    if not isinstance(w, QTensor):
        raise TypeError(f"{name} must be a QTensor, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"{name} must be 2-D, got {w.qtype.name}{tuple(w.shape)}")
    if w.qtype not in SUPPORTED:
        raise ValueError(f"no Triton kernel for {name}'s type {w.qtype.name}")
    if not w.data.is_contiguous():
        raise ValueError(f"{name}.data must be contiguous")


def _check_x(x, k: int, dev: torch.device) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float tensor, got {getattr(x, 'shape', type(x))}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight takes {k}")
    if x.device != dev:
        raise ValueError(f"x is on {x.device}, the weights on {dev}")
    if not runs_on(dev):
        raise RuntimeError(f"Triton kernels cannot run on {dev} now (available: {available()}, "
                           f"interpreting: {interpreting()})")


def _check_ffn(gate, up, down) -> tuple[int, int]:
    """(I, H) of gate, up [I, H] and down [H, I]."""
    for name, q in (("gate", gate), ("up", up), ("down", down)):
        _check_w(q, name)
    i, h = gate.shape
    if up.shape != (i, h) or down.shape != (h, i):
        raise ValueError(f"shapes gate {gate.shape}, up {up.shape}, down {down.shape}: want gate = up = (I, H), "
                         "down = (H, I)")
    if not (gate.data.device == up.data.device == down.data.device):
        raise ValueError("gate, up and down must be on one device")
    return i, h
