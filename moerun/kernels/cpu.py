"""Quantized CPU kernels that read GGUF blocks as stored (the C extension moerun.kernels._cpu).

    from moerun.kernels import cpu
    if cpu.available() and cpu.supports(w.qtype):
        y = cpu.matmul(x, w)                                  # x [T, K] f32, w QTensor [N, K] -> [T, N]
        y = cpu.moe_ffn(x, ids, weights, gate, up, down)      # one MoE layer's routed experts -> [T, H]
        y = cpu.moe_ffn_experts(x, ids, weights, {e: expert})  # the same over per-expert buffers

Activations are quantized once per call (to Q8_K for K-quant weights, to Q8_0-style 32-blocks for the
others) and every weight row is dotted against them in integer arithmetic, as llama.cpp does; results
match `x @ w.dequantize().T` to within that activation rounding (about 0.5-0.7 % relative for a matmul,
1-2 % through moe_ffn, which also rounds h = silu(gate x) * up x). Results are bitwise independent of the
thread count, and the same for the AVX2 and AVX-512 VNNI kernel sets, and through AMX tiles (batches of 16 tokens or
more of Q8_0, MXFP4, Q4_K and Q5_K rows, on CPUs that have them: set_amx).

Environment: MOERUN_KERNELS=scalar forces the portable kernels, MOERUN_KERNELS=off disables the
extension (available() is then False); MOERUN_AMX=0 keeps batches off the tiles (moerun.kernels.env). Threads: one pool per process, sized by set_threads() (default:
the physical cores this process may run on); idle workers sleep after a short spin.
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Mapping

import torch

from moerun.hostmem import Arena, host_empty
from moerun.kernels import native
from moerun.kernels.env import PREFETCH_HINTS, env_amx, env_prefetch, env_prefetch_hint, physical_cores
from moerun.kernels.native import QK_R8
from moerun.kernels.tuning import (
    set_amx,
    set_idle_prefetch,
    set_prefetch,
    set_prefetch_hint,
    set_prefetch_near,
    set_prefetch_spread,
    set_wide,
    wide_types,
)
from moerun.quant import qtypes
from moerun.quant.qtypes import QTensor, QType, block_size, row_bytes

__all__ = ["attend_prompt", "available", "can_interleave", "can_interleave_stored", "deinterleave", "deq_dot",
           "dequant_rows", "features", "get_threads", "glu_down", "has_deq_dot", "interleave", "matmul",
           "moe_ffn", "moe_ffn_experts", "read_interleaved", "set_amx", "set_idle_prefetch", "set_prefetch",
           "set_prefetch_hint", "set_prefetch_near", "set_prefetch_spread", "set_threads", "set_wide", "supports"]

MODE = native.mode()  # "" / "auto", "scalar", "off"
_cpu, _import_error = native.load(MODE)

ISA_IDS = {"scalar": 0, "avx2": 1, "avx512vnni": 2, "neon": 3}


if _cpu is not None:
    _cpu.set_threads(physical_cores())
    _cpu.set_prefetch(env_prefetch())
    _cpu.set_prefetch_hint(env_prefetch_hint())
    _cpu.set_prefetch_near(env_prefetch("MOERUN_PREFETCH_NEAR"))
    _cpu.set_amx(env_amx())
    _SUPPORTED = frozenset(QType(t) for t in _cpu.qtypes())
    _ISAS = tuple(_cpu.features()["isas"])
    _DEFAULT_ISA = native.default_isa(_cpu, MODE)
else:
    _SUPPORTED = frozenset()
    _ISAS = ()
    _DEFAULT_ISA = None


def available() -> bool:
    """True when the extension is built, importable and not disabled."""
    return _cpu is not None


def features() -> dict:
    """{"available", "isa" (the kernel set calls use), "isas" (all this CPU runs), "threads", "spin_us", "prefetch",
    "prefetch_hint" ("t0" .. "nta"), "prefetch_spread", "idle_prefetch", "prefetch_near" (the set_* values), "wide" (the types set_wide
    put on 512-bit vectors), "amx" (batches through AMX tiles now), "amx_usable" (the CPU and kernel allow them),
    "qtypes", "reason" (why not available, else None)}."""
    if _cpu is None:
        return {"available": False, "isa": None, "isas": [], "threads": 0, "spin_us": 0, "prefetch": 0,
                "prefetch_hint": None, "wide": [], "prefetch_spread": False, "idle_prefetch": 0, "prefetch_near": 0,
                "amx": False, "amx_usable": False,
                "qtypes": [], "reason": _import_error}
    f = _cpu.features()
    return {"available": True, "isa": _DEFAULT_ISA, "isas": f["isas"], "threads": f["threads"],
            "spin_us": f["spin_us"], "prefetch": f["prefetch"], "prefetch_hint": PREFETCH_HINTS[f["prefetch_hint"]],
            "wide": wide_types(f["wide"]), "prefetch_spread": f["prefetch_spread"],
            "idle_prefetch": f["idle_prefetch"], "prefetch_near": f["prefetch_near"], "amx": f["amx"],
            "amx_usable": f["amx_usable"], "qtypes": sorted(q.name for q in _SUPPORTED), "reason": None}


def supports(qtype) -> bool:
    """Whether matmul / moe_ffn take weights of this ggml type (False when the extension is unavailable)."""
    try:
        return QType(qtype) in _SUPPORTED
    except ValueError:
        return False


def set_threads(n: int, spin_us: int | None = None) -> None:
    """Size the process's kernel thread pool (n >= 1, the calling thread included). spin_us: how long an
    idle thread spins before it sleeps (default 50)."""
    _need()
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive int, got {n!r}")
    if spin_us is not None and (not isinstance(spin_us, int) or spin_us < 0):
        raise ValueError(f"spin_us must be a non-negative int, got {spin_us!r}")
    _cpu.set_threads(n, -1 if spin_us is None else spin_us)


def read_bw(buf: torch.Tensor, streams: int = 1, prefetch: int = 0) -> int:
    """Read every byte of `buf` (a contiguous CPU uint8 tensor, 64-byte aligned, at least 4 KiB) on the pool,
    each thread its share as `streams` interleaved streams, prefetching `prefetch` bytes ahead (0: none): the
    read-bandwidth probe (moerun.placement.bandwidth). -> the xor of the data (so the reads happen)."""
    _need()
    if buf.dtype != torch.uint8 or not buf.is_cpu or not buf.is_contiguous() or buf.data_ptr() % 64:
        raise ValueError("buf must be a contiguous, 64-byte aligned CPU uint8 tensor")
    return _cpu.read_bw(buf.data_ptr(), buf.numel(), streams, prefetch)


def others_runnable() -> int:
    """Runnable threads of other processes now (/proc: Linux), or -1 where that cannot be read."""
    _need()
    return _cpu.others_runnable()


def set_active(n: int) -> None:
    """Run the pool's jobs on min(n, threads) threads until told otherwise (0: all of them): the cores other
    processes leave free (moerun.model.ops.free_cpus). Results do not depend on it."""
    _need()
    _cpu.set_active(n)


def get_threads() -> int:
    _need()
    return _cpu.get_threads()


# ------------------------------------------------------------------------------- interleaved rows


def can_interleave(w: QTensor) -> bool:
    """Whether `interleave` takes w: a CPU Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS, Q5_0, Q5_1 or IQ4_NL matrix (or stack of them) in
    GGUF's layout, rows a multiple of 8 (Q6_K and IQ4_XS only where the kernels have a vectorized interleaved dot: x86)."""
    return (isinstance(w, QTensor) and w.interleave == 1 and w.data.is_cpu
            and can_interleave_stored(w.qtype, w.shape))


def can_interleave_stored(qtype: QType, shape: tuple[int, ...]) -> bool:
    """`can_interleave` for a tensor of that type and shape still in a file (GGUF's layout): what `read_interleaved`
    takes."""
    return native.interleaves_stored(qtype, shape, _DEFAULT_ISA)


def read_interleaved(fd: int, offset: int, qtype: QType, shape: tuple[int, ...],
                     scratch: torch.Tensor, arena: Arena | None = None) -> QTensor | None:
    """`interleave` of the GGUF-layout tensor at `offset` of the open file `fd`, read a `scratch` at a time (a
    contiguous CPU uint8 buffer of at least 8 rows; a few hundred KiB keeps it in L2) and repacked from there on this
    thread: the GGUF-layout bytes never take memory of the tensor's size; the result is taken from `arena` while it has
    room. None when the file ends first; OSError when a read fails. One job of a load's reads (kernels/reads.py)."""
    _need()
    if not can_interleave_stored(qtype, shape):
        raise ValueError(f"cannot interleave {qtype.name}{tuple(shape)}")
    rows, rb = math.prod(shape[:-1]), row_bytes(qtype, shape[-1])
    if scratch.numel() < 8 * rb:
        raise ValueError(f"scratch of {scratch.numel()} bytes: 8 rows need {8 * rb}")
    dst = host_empty(rows * rb, arena)
    job = torch.tensor(native.read_job(fd, offset, dst.data_ptr(), rows * rb, qtype, shape), dtype=torch.int64)
    taken, done = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    _cpu.read_jobs(job.data_ptr(), 1, taken.data_ptr(), done.data_ptr(), scratch.data_ptr(), scratch.numel())
    got = int(done[0])
    if got <= -1000:
        raise OSError(-1000 - got, os.strerror(-1000 - got))
    return QTensor(dst.view(*shape[:-1], rb), qtype, tuple(shape), 8) if got == rows * rb else None


def interleave(w: QTensor) -> QTensor:
    """w's rows in groups of 8 in the kernels' interleaved layout (moerun/kernels/csrc/qk.h: one 32-byte load holds
    4 weights of each of 8 rows): a new tensor of the same size, 1.4-2x as fast to multiply where compute
    bounds it (bench/RESULTS.md). Only these kernels read it; `deinterleave` (and QTensor.dequantize) undo it."""
    _need()
    if not can_interleave(w):
        raise ValueError(f"cannot interleave {w.qtype.name}{tuple(w.shape)} (want a CPU Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, "
                         "IQ4_XS, Q5_0, Q5_1 or IQ4_NL matrix, "
                         "rows a multiple of 8, in GGUF's layout)")
    return _relayout(_cpu.repack, w, 8)


def interleave_into(w: QTensor, dst: torch.Tensor) -> QTensor:
    """`interleave` writing into `dst` (a contiguous CPU uint8 buffer of w's size, not overlapping w's bytes):
    how an expert read from the file lands in a cache slot in the layout resident experts have."""
    _need()
    if not can_interleave(w):
        raise ValueError(f"cannot interleave {w.qtype.name}{tuple(w.shape)}")
    src = w.data.contiguous()
    if dst.dtype != torch.uint8 or not dst.is_cpu or not dst.is_contiguous() or dst.numel() != src.numel():
        raise ValueError(f"dst must be a contiguous CPU uint8 buffer of {src.numel()} bytes")
    _cpu.repack(int(w.qtype) + QK_R8, src.data_ptr(), dst.data_ptr(), w.numel // w.shape[-1], w.shape[-1])
    return QTensor(dst.view(src.shape), w.qtype, w.shape, 8)


def deinterleave(w: QTensor) -> QTensor:
    """The GGUF-layout copy of an interleaved tensor (byte for byte what it was made from)."""
    _need()
    if not isinstance(w, QTensor) or w.interleave == 1:
        raise ValueError("not an interleaved QTensor")
    return _relayout(_cpu.unpack, w, 1)


qtypes.set_deinterleave(deinterleave)  # QTensor.dequantize reads interleaved tensors back through it


def _relayout(fn, w: QTensor, interleave: int) -> QTensor:
    src = w.data.contiguous()
    dst = host_empty(src.numel()).view(src.shape)
    rows = w.numel // w.shape[-1]  # groups of 8 never straddle two matrices of a stack (rows % 8 == 0)
    fn(int(w.qtype) + QK_R8, src.data_ptr(), dst.data_ptr(), rows, w.shape[-1])
    return QTensor(dst, w.qtype, w.shape, interleave)


def _type(w: QTensor) -> int:
    """The type id the C kernels take for w."""
    return int(w.qtype) + (QK_R8 if w.interleave != 1 else 0)


# ------------------------------------------------------------------------------------------ calls


def matmul(x: torch.Tensor, w: QTensor, *, isa: str | None = None) -> torch.Tensor:
    """x [T, K] float32 @ w[N, K]^T -> [T, N] float32, w read as stored (a supported qtype)."""
    isa_id = _isa(isa)
    _check_x(x, "x")
    _check_q(w, "w", 2)
    T, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x has {K} columns but w {w.qtype.name}{tuple(w.shape)} expects {w.shape[1]}")
    out = torch.empty((T, N), dtype=torch.float32)
    if T:
        _cpu.matmul(isa_id, _type(w), w.data.data_ptr(), N, K, x.data_ptr(), T, out.data_ptr())
    return out


def glu_down(g: torch.Tensor, u: torch.Tensor, down, gate: torch.Tensor | None = None, *,
             isa: str | None = None) -> torch.Tensor:
    """down(silu(g) * u) [T, H] for g, u [T, F] float32 (g is used up), scaled row by row by sigmoid(gate [T, 1])
    when given: a shared expert's or a dense FFN's second half, computed as the fused layers compute it. down: a
    QTensor of a supported type or a contiguous float32 CPU matrix."""
    isa_id = _isa(isa)
    _check_x(g, "g")
    _check_x(u, "u")
    if isinstance(down, QTensor):
        _check_q(down, "down", 2)
        ptr, ggml = down.data.data_ptr(), _type(down)
    else:
        _check_x(down, "down")
        ptr, ggml = down.data_ptr(), 0  # GGML_F32
    T, F = g.shape
    H = down.shape[0]
    if u.shape != g.shape or down.shape[1] != F or (gate is not None and gate.numel() != T):
        raise ValueError(f"g {tuple(g.shape)}, u {tuple(u.shape)} and down {tuple(down.shape)} do not agree")
    gl = None if gate is None else gate.to(torch.float32).contiguous()
    out = torch.empty((T, H), dtype=torch.float32)
    if T:
        _cpu.glu_down(isa_id, g.data_ptr(), u.data_ptr(), T, F, H, ptr, ggml,
                      0 if gl is None else gl.data_ptr(), out.data_ptr())
    return out


MATMULS_MAX = 4  # matmul.h QK_MM_MAX


def matmuls(x: torch.Tensor, ws: list, *, isa: str | None = None) -> list[torch.Tensor]:
    """[x @ w^T for w in ws] in one call (at most MATMULS_MAX): each w a QTensor [N, K] of a supported qtype or a
    float32 tensor [N, K]; x [T, K] float32 -> [T, N] float32 each."""
    isa_id = _isa(isa)
    _check_x(x, "x")
    T, K = x.shape
    if not 1 <= len(ws) <= MATMULS_MAX:
        raise ValueError(f"matmuls takes 1..{MATMULS_MAX} matrices, got {len(ws)}")
    outs, mats = [], []
    for w in ws:
        if isinstance(w, QTensor):
            _check_q(w, "w", 2)
            ptr, ggml = w.data.data_ptr(), _type(w)
        elif w.dtype == torch.float32 and w.is_cpu and w.is_contiguous() and w.dim() == 2:
            ptr, ggml = w.data_ptr(), 0  # GGML_F32
        else:
            raise ValueError("matmuls takes QTensors or contiguous float32 CPU matrices")
        if w.shape[1] != K:
            raise ValueError(f"x has {K} columns but a matrix {tuple(w.shape)} expects {w.shape[1]}")
        outs.append(torch.empty((T, w.shape[0]), dtype=torch.float32))
        mats.append((ptr, ggml, w.shape[0], outs[-1].data_ptr()))
    if T:
        _cpu.matmuls(isa_id, x.data_ptr(), T, K, tuple(mats))
    return outs


def has_deq_dot(qtype: QType, isa: str | None = None) -> bool:
    """Whether deq_dot (and the fused MLA's W_UK / W_UV in their file's type) has a kernel for qtype here."""
    if qtype not in _SUPPORTED:
        return False
    elems = block_size(qtype)[0]
    return bool(_cpu.deq_dot(_isa(isa), int(qtype), 0, 0, elems, 0, 0))


def deq_dot(w: QTensor, x: torch.Tensor, isa: str | None = None) -> torch.Tensor | None:
    """w [N, K] (GGUF's layout) times float32 x [K] -> [N], each row dequantized in registers and dotted as the fused
    path's float kernel dots float rows (the same bits as that kernel on dequant_rows' values), or None where this
    CPU or kernel set has no such kernel for w's type (AVX-512 only; MLA's W_UK / W_UV then stay float32)."""
    i = _isa(isa)
    _check_q(w, "w", 2)
    if w.interleave != 1:
        raise ValueError("deq_dot reads GGUF's layout; this matrix is interleaved")
    N, K = w.shape
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous()
            and tuple(x.shape) == (K,)):
        raise ValueError(f"x must be a contiguous float32 CPU vector of {K} values")
    out = torch.empty(N, dtype=torch.float32)
    return out if _cpu.deq_dot(i, int(w.qtype), w.data.data_ptr(), N, K, x.data_ptr(), out.data_ptr()) else None


def dequant_rows(w: QTensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of w [N, K] (a supported qtype) as float32 [len(rows), K]: the values gguf.quants gives (an
    embedding lookup without dequantizing the table)."""
    _need()
    _check_q(w, "w", 2)
    if w.interleave != 1:
        raise ValueError("dequant_rows reads GGUF's layout; this matrix is interleaved")
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError("rows must be a 1-D int64 tensor")
    rows = rows.contiguous()
    N, K = w.shape
    out = torch.empty((len(rows), K), dtype=torch.float32)
    if len(rows):
        _cpu.dequant_rows(int(w.qtype), w.data.data_ptr(), N, K, rows.data_ptr(), len(rows), out.data_ptr())
    return out


def moe_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: QTensor, up: QTensor,
            down: QTensor, *, isa: str | None = None, fn=None) -> torch.Tensor:
    """One MoE layer's routed experts: out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),
    e = ids[t, j], summed in the order of j.

    x [T, H] float32; ids [T, k] int32/int64 in [0, E); weights [T, k] float; gate, up QTensor [E, I, H];
    down QTensor [E, H, I] (each of any supported qtype). Returns [T, H] float32.
    fn: another activation and biases (an object with `act` "swiglu" | "swiglu_oai", `alpha`, `limit`, `biases`
    None or float32 (gate [E, I], up [E, I], down [E, H]); moerun.model.ops.ExpertFn), or None: plain SwiGLU.
    """
    isa_id = _isa(isa)
    for name, q in (("gate", gate), ("up", up), ("down", down)):
        _check_q(q, name, 3)
    E, I, H = gate.shape
    if up.shape != (E, I, H) or down.shape != (E, H, I):
        raise ValueError(f"expert shapes gate {gate.shape}, up {up.shape}, down {down.shape}: want gate = up = "
                         f"(E, I, H) and down = (E, H, I)")
    mats = [(q.data.data_ptr(), q.nbytes // E, _type(q)) for q in (gate, up, down)]
    return _moe(isa_id, x, ids, weights, mats, E, I, H, fn=_fn_args(fn, E, I, H))


def moe_ffn_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Mapping[int, object], *,
                    isa: str | None = None, pairs: bool = False, out: torch.Tensor | None = None,
                    fn=None) -> torch.Tensor:
    """moe_ffn over experts held one by one: `experts` maps expert id -> an object with QTensors `gate`,
    `up` [I, H] and `down` [H, I] (moerun.experts.store.Expert), wherever their buffers lie (a memory map,
    owned RAM, a cache slot). Every id in `ids` must be a key, or negative (that pair is skipped); all experts
    share shapes and qtypes.

    pairs: return [T * k, H], row t * k + j = weights[t, j] * expert(x_t) for e = ids[t, j] (0 where skipped),
    instead of the sum per token: pairs computed by separate calls, summed in the order of j, equal one
    call's sum exactly. out: a float32 buffer of the result's shape to write into (e.g. pinned memory). fn: as
    moe_ffn's (biases by expert id, for every id given)."""
    isa_id = _isa(isa)
    if not experts:
        raise ValueError("experts is empty")
    items = sorted(experts.items())
    first = items[0][1]
    for name in ("gate", "up", "down"):
        _check_q(getattr(first, name, None), f"experts[{items[0][0]}].{name}", 2)
    I, H = first.gate.shape
    if first.up.shape != (I, H) or first.down.shape != (H, I):
        raise ValueError(f"expert shapes gate {first.gate.shape}, up {first.up.shape}, down {first.down.shape}: "
                         "want gate = up = (I, H) and down = (H, I)")
    E = items[-1][0] + 1
    if items[0][0] < 0:
        raise ValueError(f"negative expert id {items[0][0]}")
    table = array("Q", bytes(24 * E))  # gate | up | down addresses, 0 where not given
    like = [(q.qtype, q.shape, q.interleave) for q in (first.gate, first.up, first.down)]
    names = ("gate", "up", "down")
    try:  # on the decode path for every layer: plain attribute checks only
        for e, ex in items:
            for m, (qtype, shape, il) in enumerate(like):
                q = getattr(ex, names[m])
                data = q.data
                if (q.qtype is not qtype or q.shape != shape or q.interleave != il or not data.is_cpu
                        or not data.is_contiguous()):
                    raise TypeError
                table[m * E + e] = data.data_ptr()
    except (AttributeError, TypeError):
        raise ValueError(f"experts[{e}].{names[m]} is not a contiguous CPU {like[m][0].name}{like[m][1]} QTensor "
                         f"laid out like experts[{items[0][0]}]") from None
    base = table.buffer_info()[0]
    mats = [(base + 8 * m * E, 0, _type(q)) for m, q in enumerate((first.gate, first.up, first.down))]
    return _moe(isa_id, x, ids, weights, mats, E, I, H, pairs=pairs, out=out, fn=_fn_args(fn, E, I, H))


ACTS = {"swiglu": 0, "swiglu_oai": 1}  # matmul.h QK_ACT_*


def _fn_args(fn, E: int, I: int, H: int) -> tuple:
    """(act, alpha, limit, gate_b, up_b, down_b) for the C call, from an ExpertFn-like `fn` (None: plain), its
    biases checked to cover experts 0..E-1."""
    if fn is None:
        return ()
    if fn.act not in ACTS:
        raise ValueError(f"activation {fn.act!r} not in {list(ACTS)}")
    ptrs = [0, 0, 0]
    if fn.biases is not None:
        for m, (b, n) in enumerate(zip(fn.biases, (I, I, H))):
            if not (isinstance(b, torch.Tensor) and b.dtype == torch.float32 and b.is_cpu and b.is_contiguous()
                    and b.dim() == 2 and b.shape[0] >= E and b.shape[1] == n):
                raise ValueError(f"expert biases must be contiguous float32 CPU [>= {E}, {n}], got "
                                 f"{getattr(b, 'dtype', type(b))} {tuple(getattr(b, 'shape', ()))}")
            ptrs[m] = b.data_ptr()
    return (ACTS[fn.act], float(fn.alpha), float(fn.limit), *ptrs)


def _moe(isa_id: int, x, ids, weights, mats, E: int, I: int, H: int, pairs: bool = False,
         out: torch.Tensor | None = None, fn: tuple = ()) -> torch.Tensor:
    _check_x(x, "x")
    T = x.shape[0]
    if x.shape[1] != H:
        raise ValueError(f"x has {x.shape[1]} features but the experts take {H}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an int32 or int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        raise ValueError(f"weights must be a float tensor, got {getattr(weights, 'dtype', type(weights))}")
    if ids.dim() != 2 or ids.shape[0] != T or ids.shape != weights.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T={T}, k]")
    if not ids.is_cpu or not weights.is_cpu:
        raise ValueError("ids and weights must be CPU tensors")
    k = ids.shape[1]
    shape = (T * k, H) if pairs else (T, H)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif out.shape != shape or out.dtype != torch.float32 or not out.is_cpu or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {shape}")
    if T == 0 or k == 0:
        return out.zero_()
    ids32 = ids.to(torch.int32).contiguous()
    w32 = weights.to(torch.float32).contiguous()
    (g, gs, gt), (u, us, ut), (d, ds, dt) = mats
    _cpu.moe_ffn(isa_id, x.data_ptr(), T, H, ids32.data_ptr(), w32.data_ptr(), k, g, gs, gt, u, us, ut, d, ds, dt,
                 E, I, out.data_ptr(), int(pairs), *fn)
    return out


# ------------------------------------------------------------------------ fused decode attention

FLOAT_TYPES = {torch.float32: 0}  # ggml F32; float weights enter the fused path as float32 tensors


def attend_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  scale: float, sinks: torch.Tensor | None = None, window: int = 0, *, isa: str | None = None
                  ) -> torch.Tensor:
    """moerun.model.layers.attend in one call (flash style, on the pool): q [T, nh, D], k [S, nkv, D], v [S, nkv, Dv]
    float32, positions [T] and [S] (k_pos ascending) -> [T, nh * Dv]. D <= 256, Dv a multiple of 16."""
    isa_id = _isa(isa)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k and v must be [T, heads, D]")
    (T, nh, D), (S, nkv, Dv) = q.shape, v.shape
    if k.shape != (S, nkv, D) or nh % nkv or len(q_pos) != T or len(k_pos) != S:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit GQA attention")
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("sinks", sinks),) if sinks is not None else ()):
        if t.dtype != torch.float32 or not t.is_cpu:
            raise ValueError(f"{name} must be a float32 CPU tensor")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    qp, kp = (p.to(device="cpu", dtype=torch.int64).contiguous() for p in (q_pos, k_pos))
    sk = sinks.contiguous() if sinks is not None else None
    out = torch.empty((T, nh * Dv), dtype=torch.float32)
    if T and S:
        _cpu.attn_prompt(isa_id, q.data_ptr(), T, nh, D, k.data_ptr(), v.data_ptr(), S, nkv, Dv, qp.data_ptr(),
                         kp.data_ptr(), float(scale), int(window), 0 if sk is None else sk.data_ptr(), out.data_ptr())
    return out


# ------------------------------------------------------------------------------------------ checks


def _need() -> None:
    if _cpu is None:
        raise RuntimeError(f"CPU kernels unavailable: {_import_error}")


def _isa(isa: str | None) -> int:
    _need()
    name = _DEFAULT_ISA if isa is None else isa
    if name not in _ISAS:
        raise ValueError(f"kernel set {name!r} not available here (have {list(_ISAS)})")
    return ISA_IDS[name]


def _check_x(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, features], got shape {tuple(x.shape)}")
    if not x.is_cpu:
        raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _check_q(w, name: str, dims: int) -> None:
    if not isinstance(w, QTensor):
        raise TypeError(f"{name} must be a QTensor, got {type(w).__name__}")
    if len(w.shape) != dims:
        raise ValueError(f"{name} must be {dims}-D, got {w.qtype.name}{tuple(w.shape)}")
    if w.qtype not in _SUPPORTED:
        raise ValueError(f"no CPU kernel for {name}'s type {w.qtype.name} (have {features()['qtypes']})")
    if not w.data.is_cpu or not w.data.is_contiguous():
        raise ValueError(f"{name}.data must be a contiguous CPU tensor")
