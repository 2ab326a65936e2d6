"""Triton GPU kernels that read GGUF blocks as stored, dequantizing in registers.

    from moerun.kernels import triton_q
    if triton_q.available() and triton_q.supports(w.qtype):
        y = triton_q.matmul(x, w)                        # x [T, K] float @ w QTensor [N, K]^T -> [T, N]
        y = triton_q.swiglu(x, gate, up, down)           # down(silu(gate x) * up x) -> [T, H]
        y = triton_q.moe_ffn(x, ids, weights, experts)   # {e: Expert}: ReferenceOps.moe -> [T, H]

Weights (QTensor.data, uint8) and activations must be on the same device: CUDA, or the CPU when
TRITON_INTERPRET=1 (triton's interpreter, how the tests run without a GPU). Activations are not
quantized: every product and sum is float32, so results match x @ w.dequantize().T to float32
accumulation error. Results come back in x's dtype.

moe_ffn sorts the (token, choice) pairs by expert on the device (no count comes back to the host) and
runs two grouped launches: gate and up together with SiLU(gate) * up fused, then down scaled by the
routing weight into one row per pair; a token's rows are summed in choice order (ReferenceOps.moe adds
experts in id order: the results differ by float32 rounding only).

This module imports without triton (available() is then False); triton is imported, and the kernels
are built, at the first call, reading TRITON_INTERPRET then (and rebuilding if it has changed).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping

import torch

from moerun.quant.dequant import KV_IQ4NL, KV_MXFP4
from moerun.quant.qtypes import QTensor, QType, row_bytes

__all__ = ["SUPPORTED", "ExpertTable", "available", "dequantize", "matmul", "moe_ffn", "supports", "swiglu"]

SUPPORTED = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, QType.MXFP4})
CODEBOOKS = {QType.IQ4_XS: KV_IQ4NL, QType.MXFP4: KV_MXFP4}


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
    """The kernel module, (re)imported when absent or built under another TRITON_INTERPRET."""
    if _triton_error() is not None:
        raise RuntimeError(f"triton unavailable: {_triton_error()}")
    mode = interpreting()
    dq = _modules.get("dq") or importlib.import_module("moerun.kernels.triton_dequant")
    gm = _modules.get("gm") or importlib.import_module("moerun.kernels.triton_moe")
    if dq.INTERPRETED != mode:
        dq = importlib.reload(dq)
        gm = importlib.reload(gm)  # it holds dq's dq_tile
    elif gm.INTERPRETED != mode:
        gm = importlib.reload(gm)
    _modules.update(dq=dq, gm=gm)
    return dq, gm


@functools.cache
def _codebook(qtype: QType, device: torch.device) -> torch.Tensor:
    return CODEBOOKS.get(qtype, KV_IQ4NL).to(device)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# rows per tile -> (BN, BK, num_warps). Chosen offline: compiled for sm_90 (triton.compile with a
# GPUTarget, no device needed) and read with cuobjdump, every type and layout fits in 255 registers
# with at most 32 bytes of stack (BM=32 gate+up on IQ4_XS / MXFP4). Not timed on a GPU yet.
TILES = {1: (16, 64, 4), 2: (16, 64, 4), 4: (32, 32, 4), 8: (16, 32, 4), 16: (32, 32, 8), 32: (32, 32, 8)}
# The interpreter's cost is per program and per operation, not per element: fewer, larger tiles.
INTERPRETER_TILES = {bm: (64, 256, 4) for bm in TILES}


def _tiles(rows: int, k: int) -> dict:
    """Block sizes for about `rows` activation rows per tile: a broadcast-multiply GEMV below 16 rows,
    tl.dot (float32, ieee) from 16 up."""
    bm = min(32, _pow2(rows))
    bn, bk, warps = (INTERPRETER_TILES if interpreting() else TILES)[bm]
    return {"BM": bm, "BN": bn, "BK": min(bk, _pow2(k)), "USE_DOT": bm >= 16, "num_warps": warps}


# ------------------------------------------------------------------------------------------ calls


def dequantize(w: QTensor) -> torch.Tensor:
    """w [N, K] -> float32 [N, K] on w's device (the kernels' dequantizer alone; for tests)."""
    _check_w(w, "w")
    if not runs_on(w.data.device):
        raise RuntimeError(f"Triton kernels cannot run on {w.data.device} now")
    dq, _ = _kernels()
    n, k = w.shape
    out = torch.empty((n, k), dtype=torch.float32, device=w.data.device)
    bn, bk = 32, 64
    grid = (_cdiv(n, bn), _cdiv(k, bk))
    dq.dequantize_kernel[grid](w.data, out, _codebook(w.qtype, w.data.device), n, k, row_bytes(w.qtype, k),
                               QTYPE=int(w.qtype), BN=bn, BK=bk)
    return out


def matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [T, K] @ w[N, K]^T -> [T, N] in x.dtype (float32 inside)."""
    _check_w(w, "w")
    _check_x(x, w.shape[1], w.data.device)
    x = x.contiguous()
    t, (n, k) = x.shape[0], w.shape
    out = torch.empty((t, n), dtype=torch.float32, device=x.device)
    if t:
        _gemm(x, out, (t, n, k), w, tiles=_tiles(t, k))
    return out.to(x.dtype)


def swiglu(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> torch.Tensor:
    """down(silu(gate x) * up x): x [T, H], gate/up [I, H], down [H, I] -> [T, H] in x.dtype."""
    i, h = _check_ffn(gate, up, down)
    _check_x(x, h, gate.data.device)
    x = x.contiguous()
    t = x.shape[0]
    hid = torch.empty((t, i), dtype=torch.float32, device=x.device)  # [T, I]
    out = torch.empty((t, h), dtype=torch.float32, device=x.device)  # [T, H]
    if t:
        _gemm(x, hid, (t, i, h), gate, w2=up, tiles=_tiles(t, h))
        _gemm(hid, out, (t, h, i), down, tiles=_tiles(t, i))
    return out.to(x.dtype)


class ExpertTable:
    """What moe_ffn derives from an experts mapping before it can launch (their shared shapes, the device
    table of their weight addresses, the id -> slot lookup): build it once for experts that stay put (all of
    a layer's, resident on the GPU) and pass it to every call."""

    def __init__(self, experts: Mapping[int, object]):
        if not experts:
            raise ValueError("experts is empty")
        self.keys = sorted(experts)
        self.first = experts[self.keys[0]]
        self.dev = self.first.gate.data.device
        self.addrs = _weight_tables(experts, self.keys, self.first, self.dev)  # (gate, up, down) address per slot
        self.lut = _lut(self.keys, self.dev)


def moe_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Mapping[int, object],
            pairs: bool = False, table: ExpertTable | None = None) -> torch.Tensor:
    """sum over each token's k choices of weights * expert(x), as ReferenceOps.moe: x [T, H], ids and
    weights [T, k], experts {id: Expert} sharing shapes and qtypes (ids without an entry add nothing).
    Returns [T, H] in x.dtype; with `pairs`, [T * k, H] float32, one weighted row per (token, choice) pair
    (0 where the id has no entry), unsummed (ReferenceOps.moe_pairs)."""
    table = table or ExpertTable(experts)
    keys, first, dev = table.keys, table.first, table.dev
    i, h = _check_ffn(first.gate, first.up, first.down)
    _check_x(x, h, dev)
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, k]")
    x = x.contiguous()
    t, kk = ids.shape
    m = t * kk
    if m == 0:
        return torch.zeros((0, h), dtype=torch.float32, device=x.device) if pairs else torch.zeros_like(x)
    tables = table.addrs
    rows = max(1, m // len(keys))
    pair, tiles_up, tiles_down = _schedule(ids.to(dev), keys, table.lut, rows, _tiles(rows, h), _tiles(rows, i))
    hid = torch.empty((m, i), dtype=torch.float32, device=dev)  # [T*k, I], row = pair
    y = torch.zeros((m, h), dtype=torch.float32, device=dev)  # [T*k, H]
    scale = weights.to(device=dev, dtype=torch.float32).contiguous()
    _gemm(x, hid, (m, i, h), first.gate, w2=first.up, tiles=tiles_up[1], grouped=(pair, kk, tiles_up[0]),
          addrs=tables[:2])
    _gemm(hid, y, (m, h, i), first.down, tiles=tiles_down[1], grouped=(pair, 1, tiles_down[0]),
          addrs=tables[2:], scale=scale)
    if pairs:
        return y
    return y.view(t, kk, h).sum(1).to(x.dtype)


# --------------------------------------------------------------------------------------- launches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gemm(a: torch.Tensor, out: torch.Tensor, mnk: tuple[int, int, int], w: QTensor, *, tiles: dict,
          w2: QTensor | None = None, grouped=None, addrs=None, scale: torch.Tensor | None = None) -> None:
    """One qgemm_kernel launch. grouped: (pair [T*k] int32, a_div, tile table [U, 3] int32), with
    addrs the int64 address tables of w (and w2) per slot; else plain on w's (and w2's) bytes."""
    _, gm = _kernels()
    m, n, k = mnk
    w2 = w if w2 is None else w2
    dev = a.device
    if grouped is None:
        pair, a_div, table = out, 1, out  # unused placeholders
        wa, wb = w.data, w2.data
        grid_m = _cdiv(m, tiles["BM"])
    else:
        pair, a_div, table = grouped
        wa, wb = addrs[0], addrs[-1]
        grid_m = table.shape[0]
    gm.qgemm_kernel[(grid_m, _cdiv(n, tiles["BN"]))](
        a, a.stride(0), out, out.stride(0), pair, a_div, out if scale is None else scale, table,
        wa, wb, row_bytes(w.qtype, k), row_bytes(w2.qtype, k), _codebook(w.qtype, dev), _codebook(w2.qtype, dev),
        m, n, k, QTYPE=int(w.qtype), QTYPE2=int(w2.qtype), GROUPED=grouped is not None,
        GATED=w2 is not w, SCALED=scale is not None, **tiles)


def _weight_tables(experts: Mapping[int, object], keys: list[int], first, dev: torch.device) -> torch.Tensor:
    """[3, slots] int64: the gate, up and down data addresses of the experts in ascending id order."""
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
    return _to_device(torch.tensor(addrs, dtype=torch.int64), dev)


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on dev; to a GPU through pinned memory, so the copy does not wait for the GPU."""
    from moerun.device import upload

    return upload(t, dev)


def _lut(keys: list[int], dev: torch.device) -> torch.Tensor:
    """expert id -> its slot among the sorted keys, len(keys) for none; ids up to keys[-1] + 1, on dev."""
    lut = torch.full((keys[-1] + 2,), len(keys), dtype=torch.int64)
    lut[keys] = torch.arange(len(keys))
    return _to_device(lut, dev)


def _schedule(ids: torch.Tensor, keys: list[int], lut: torch.Tensor, rows: int, *tile_sizes: dict):
    """Sort the T*k pairs by expert slot and cut each slot's run into tiles, on the device.

    Returns pair [T*k] int32 (pair indices, sorted by slot; pairs whose id has no expert last, in no
    tile) and, per entry of tile_sizes, (tile table [U, 3] int32, the sizes). U is the bound
    cdiv(T*k, BM) + slots, so no count comes back to the host; spare tiles have slot -1.
    """
    dev = ids.device
    n = len(keys)
    flat = ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat <= keys[-1]), flat, keys[-1] + 1)
    slot = lut[flat]  # [T*k], n = no expert
    pair = torch.argsort(slot, stable=True)
    counts = torch.bincount(slot, minlength=n + 1)[:n]  # [slots]
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
