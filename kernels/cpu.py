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
thread count, and the same for the AVX2 and AVX-512 VNNI kernel sets.

Environment: MOERUN_KERNELS=scalar forces the portable kernels, MOERUN_KERNELS=off disables the
extension (available() is then False). Threads: one pool per process, sized by set_threads() (default:
the physical cores this process may run on); idle workers sleep after a short spin.
"""

from __future__ import annotations

import os
import weakref
from array import array
from collections.abc import Mapping

import torch

from moerun.quant.qtypes import INTERLEAVABLE, QTensor, QType

__all__ = ["AttnLayer", "AttnRows", "Embedding", "Head", "LayerStack", "attend_prompt", "attn_block", "available", "can_interleave", "decode_layers",
           "decode_tokens", "deinterleave", "dequant_rows", "features", "get_threads", "head_logits", "interleave", "matmul", "moe_ffn",
           "moe_ffn_experts", "set_prefetch", "set_threads", "supports"]

MODE = os.environ.get("MOERUN_KERNELS", "").strip().lower()  # "" / "auto", "scalar", "off"

_cpu = None
_import_error: str | None = None
if MODE == "off":
    _import_error = "disabled by MOERUN_KERNELS=off"
elif MODE not in ("", "auto", "scalar"):
    _import_error = f"MOERUN_KERNELS={MODE!r} is not one of auto, scalar, off"
else:
    try:
        from moerun.kernels import _cpu
    except ImportError as e:  # not built (e.g. a source tree without `pip install -e .`)
        _import_error = f"moerun.kernels._cpu is not built: {e}"

ISA_IDS = {"scalar": 0, "avx2": 1, "avx512vnni": 2, "neon": 3}
QK_R8 = 1000  # qk.h: an interleaved layout's type id is the ggml type's + QK_R8


def _physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (logical CPUs when unknown)."""
    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:
        logical = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
        total = psutil.cpu_count(logical=True) or logical
        # an affinity mask of fewer CPUs than the machine has: scale by threads per core
        return max(1, min(logical, physical, logical * physical // max(total, 1)))
    except ImportError:
        return max(1, logical)


def _env_prefetch() -> int:
    """MOERUN_PREFETCH: the interleaved kernels' prefetch distance for a few tokens, in bytes (unset or "auto": the CPU's
    default, see set_prefetch)."""
    v = os.environ.get("MOERUN_PREFETCH", "auto").strip().lower()
    if v in ("", "auto"):
        return -1
    if not v.isdigit() or int(v) % 64 or int(v) > 65536:
        import warnings

        warnings.warn(f"MOERUN_PREFETCH={v!r} is not auto or a multiple of 64 bytes in 0..65536: using the CPU's "
                      "default", stacklevel=2)
        return -1
    return int(v)


if _cpu is not None:
    _cpu.set_threads(_physical_cores())
    _cpu.set_prefetch(_env_prefetch())
    _SUPPORTED = frozenset(QType(t) for t in _cpu.qtypes())
    _ISAS = tuple(_cpu.features()["isas"])
    _DEFAULT_ISA = "scalar" if MODE == "scalar" else _cpu.features()["best"]
else:
    _SUPPORTED = frozenset()
    _ISAS = ()
    _DEFAULT_ISA = None


def available() -> bool:
    """True when the extension is built, importable and not disabled."""
    return _cpu is not None


def features() -> dict:
    """{"available", "isa" (the kernel set calls use), "isas" (all this CPU runs), "threads", "spin_us",
    "prefetch" (set_prefetch's bytes), "qtypes", "reason" (why not available, else None)}."""
    if _cpu is None:
        return {"available": False, "isa": None, "isas": [], "threads": 0, "spin_us": 0, "prefetch": 0, "qtypes": [],
                "reason": _import_error}
    f = _cpu.features()
    return {"available": True, "isa": _DEFAULT_ISA, "isas": f["isas"], "threads": f["threads"],
            "spin_us": f["spin_us"], "prefetch": f["prefetch"], "qtypes": sorted(q.name for q in _SUPPORTED),
            "reason": None}


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


def set_prefetch(nbytes: int | None = None) -> None:
    """How far ahead (bytes, a multiple of 64 up to 65536; 0: not at all) the interleaved-layout kernels prefetch
    weight rows into L2 when they multiply one token (or up to 8 with AVX-512 VNNI). None: the CPU's default (2048
    on Intel, 0 elsewhere; the environment's MOERUN_PREFETCH overrides it at import); while it is not 0 the
    GGUF-layout kernels' own one-token prefetch goes to L2 as well. Results do not depend on it, only speed."""
    _need()
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or nbytes % 64
                               or nbytes > 65536):
        raise ValueError(f"prefetch must be a multiple of 64 bytes in 0..65536, got {nbytes!r}")
    _cpu.set_prefetch(-1 if nbytes is None else nbytes)


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


# interleaved layouts with only the portable kernel in a set whose GGUF-layout kernel is vectorized: kept in GGUF's
# layout where that set runs
_KEEP_GGUF = {"neon": frozenset({QType.Q6_K, QType.IQ4_XS})}


def can_interleave(w: QTensor) -> bool:
    """Whether `interleave` takes w: a CPU Q4_K, Q6_K, Q8_0, MXFP4 or IQ4_XS matrix (or stack of them) in GGUF's
    layout, rows a multiple of 8 (Q6_K and IQ4_XS only where the kernels have a vectorized interleaved dot: x86)."""
    return (_cpu is not None and isinstance(w, QTensor) and 8 in INTERLEAVABLE.get(w.qtype, ())
            and w.qtype not in _KEEP_GGUF.get(_DEFAULT_ISA, ())
            and w.interleave == 1 and len(w.shape) in (2, 3) and w.shape[-2] % 8 == 0 and w.data.is_cpu)


def interleave(w: QTensor) -> QTensor:
    """w's rows in groups of 8 in the kernels' interleaved layout (kernels/csrc/qk.h: one 32-byte load holds
    4 weights of each of 8 rows): a new tensor of the same size, 1.4-2x as fast to multiply where compute
    bounds it (bench/RESULTS.md). Only these kernels read it; `deinterleave` (and QTensor.dequantize) undo it."""
    _need()
    if not can_interleave(w):
        raise ValueError(f"cannot interleave {w.qtype.name}{tuple(w.shape)} (want a CPU Q4_K, Q6_K, Q8_0, MXFP4 or IQ4_XS matrix, "
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


def _relayout(fn, w: QTensor, interleave: int) -> QTensor:
    from moerun.hostmem import host_empty

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


class AttnLayer:
    """One layer's constant part for attn_block: its weights' addresses, types and shapes, checked once.

    Weights are QTensors of a supported type or contiguous float32 tensors; norms and biases float32
    vectors. The object keeps references to everything it points to. router=None: a dense layer.
    experts: the routed experts' stacked (gate [E, I, H], up [E, I, H], down [E, H, I]) QTensors, for calls
    that finish the whole layer (attn_block(..., moe=True), decode_layers).
    gpt-oss's additions: bo the output projection's bias; sinks [n_heads] logits in the softmax's denominator;
    window > 0: attend to the last `window` positions (the rows' ring tables, AttnRows); router_b the router's
    bias; gating "softmax" (then top-k, renormalised with norm_topk) or "topk_softmax"; fn the experts'
    activation and biases (as moe_ffn's).
    """

    def __init__(self, *, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: str | None,
                 rope_style: str, attn_norm, ffn_norm, wq, wk, wv, wo, q_norm=None, k_norm=None, bq=None,
                 bk=None, bv=None, router=None, n_used: int = 0, norm_topk: bool = False, experts=None, bo=None,
                 sinks=None, window: int = 0, router_b=None, gating: str = "softmax", fn=None):
        _need()
        q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        if n_heads % n_kv_heads or head_dim % 2:
            raise ValueError(f"{n_heads} heads over {n_kv_heads} KV heads of dim {head_dim}: not supported")
        if gating not in GATINGS or window < 0:
            raise ValueError(f"gating {gating!r} not in {list(GATINGS)}, or a negative window {window}")
        f = {"hidden": hidden, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
             "qk_norm": {None: 0, "full": 1, "head": 2}[qk_norm], "neox": int(rope_style == "neox"),
             "window": window, "gating": GATINGS[gating]}
        self._keep = []
        norm_len = {"full": (q_dim, kv_dim), "head": (head_dim, head_dim)}.get(qk_norm, (None, None))
        n_experts = 0 if router is None else router.shape[0]
        for name, t, n in (("attn_norm", attn_norm, hidden), ("ffn_norm", ffn_norm, hidden),
                           ("q_norm", q_norm, norm_len[0]), ("k_norm", k_norm, norm_len[1]),
                           ("bq", bq, q_dim), ("bk", bk, kv_dim), ("bv", bv, kv_dim), ("bo", bo, hidden),
                           ("sinks", sinks, n_heads), ("router_b", router_b, n_experts or None)):
            f[name] = self._vector(name, t, n)
        for name, w, shape in (("wq", wq, (q_dim, hidden)), ("wk", wk, (kv_dim, hidden)),
                               ("wv", wv, (kv_dim, hidden)), ("wo", wo, (hidden, q_dim)),
                               ("router", router, (n_experts, hidden))):
            f[name], f[name + "_type"] = (0, 0) if w is None else self._matrix(name, w, shape)
        if router is not None and not 1 <= n_used <= n_experts:
            raise ValueError(f"n_used {n_used} out of 1..{n_experts}")
        f.update(n_experts=n_experts, n_used=n_used, norm_topk=int(norm_topk))
        f.update(self._experts(experts, n_experts, hidden))
        f.update(self._fn(fn, n_experts, f["n_ff"], hidden))
        self.desc = torch.tensor([f[name] for name in _cpu.attn_fields()], dtype=torch.int64)
        self.hidden, self.kv_dim, self.n_used, self.routed = hidden, kv_dim, n_used, router is not None
        self.whole = experts is not None  # the call can run the routed experts too
        self.window = window

    def _fn(self, fn, E: int, I: int, H: int) -> dict[str, int]:
        if fn is None:
            return {"act": 0, "act_params": 0, "gate_b": 0, "up_b": 0, "down_b": 0}
        act, alpha, limit, gb, ub, db = _fn_args(fn, E, I, H)
        params = torch.tensor([alpha, limit], dtype=torch.float32)
        self._keep += [params, *(fn.biases or ())]
        return {"act": act, "act_params": params.data_ptr(), "gate_b": gb, "up_b": ub, "down_b": db}

    def _experts(self, experts, E: int, H: int) -> dict[str, int]:
        if experts is None:
            return dict.fromkeys(("gate", "gate_stride", "gate_type", "up", "up_stride", "up_type", "down",
                                  "down_stride", "down_type", "n_ff"), 0)
        if E == 0:
            raise ValueError("experts given to a dense layer")
        gate, up, down = experts
        for name, q in (("gate", gate), ("up", up), ("down", down)):
            _check_q(q, name, 3)
        I = gate.shape[1]
        if gate.shape != (E, I, H) or up.shape != (E, I, H) or down.shape != (E, H, I):
            raise ValueError(f"expert shapes gate {gate.shape}, up {up.shape}, down {down.shape}: want gate = up = "
                             f"({E}, I, {H}) and down = ({E}, {H}, I)")
        f = {"n_ff": I}
        for name, q in (("gate", gate), ("up", up), ("down", down)):
            self._keep.append(q.data)
            f.update({name: q.data.data_ptr(), name + "_stride": q.nbytes // E, name + "_type": _type(q)})
        return f

    def _vector(self, name: str, t, n: int | None) -> int:
        if t is None:
            return 0
        if n is None or not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_cpu
                             and t.is_contiguous() and t.numel() == n):
            raise ValueError(f"{name} must be a contiguous float32 CPU vector of {n} values")
        self._keep.append(t)
        return t.data_ptr()

    def _matrix(self, name: str, w, shape) -> tuple[int, int]:
        data, ggml = _matrix_data(name, w, shape)
        self._keep.append(data)
        return data.data_ptr(), ggml


def _matrix_data(name: str, w, shape) -> tuple[torch.Tensor, int]:
    """(the bytes the kernels read, their type id) of a matrix: a supported QTensor or float32 CPU tensor."""
    if isinstance(w, QTensor):
        _check_q(w, name, 2)
        ok, data, ggml = tuple(w.shape) == shape, w.data, _type(w)
    else:
        ok = (isinstance(w, torch.Tensor) and w.dtype in FLOAT_TYPES and w.is_cpu and w.is_contiguous()
              and tuple(w.shape) == shape)
        data, ggml = w, FLOAT_TYPES.get(getattr(w, "dtype", None), -1)
    if not ok:
        raise ValueError(f"{name} must be a supported QTensor or a contiguous float32 CPU tensor of shape {shape}")
    return data, ggml


class Head:
    """The output norm and projection for decode_layers: logits = rms_norm(x, norm) @ weight^T, checked once."""

    def __init__(self, norm: torch.Tensor, weight, hidden: int):
        if not (isinstance(norm, torch.Tensor) and norm.dtype == torch.float32 and norm.is_cpu
                and norm.is_contiguous() and norm.numel() == hidden):
            raise ValueError(f"the output norm must be a contiguous float32 CPU vector of {hidden} values")
        rows = getattr(weight, "shape", (0,))[0]
        self.data, self.type = _matrix_data("head", weight, (rows, hidden))
        self.norm, self.rows, self.hidden = norm, rows, hidden


class Embedding:
    """An embedding table decode_tokens looks tokens up in (in C, as dequant_rows does): a QTensor [V, hidden] in
    GGUF's layout, of a type the kernels dequantize (else ValueError)."""

    def __init__(self, table: QTensor, hidden: int):
        _need()
        if not isinstance(table, QTensor) or table.interleave != 1 or len(table.shape) != 2 or \
                table.shape[1] != hidden or not table.data.is_cpu:
            raise ValueError(f"the embedding must be a CPU QTensor [vocab, {hidden}] in GGUF's layout")
        _check_q(table, "embedding", 2)
        self.data, self.type, self.rows, self.hidden = table.data, _type(table), table.shape[0], hidden
        try:  # no rows: only the type and width are checked
            _cpu.dequant_rows(self.type, self.data.data_ptr(), self.rows, hidden, 0, 0, 0)
        except ValueError:
            raise ValueError(f"no CPU lookup for {table.qtype.name} embeddings") from None


GATINGS = {"softmax": 0, "topk_softmax": 1}  # attn.h's gating


def _check_rows(slot_tables: list[torch.Tensor], ring_tables: list[torch.Tensor], pos: list[int],
                rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> None:
    """A step's slot tables cover their rows' positions, and the RoPE tables reach past the last (AttnRows's and
    decode_tokens' checks)."""
    for t, p in zip(slot_tables + ring_tables, pos + pos):
        if t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() or t.dim() != 1 or not 0 <= p < len(t):
            raise ValueError("slot tables must be contiguous int64 CPU vectors covering their row's position")
    for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.shape[0] <= max(pos):
            raise ValueError(f"{name} must be a contiguous float32 CPU table past position {max(pos)}")


class AttnRows:
    """The rows of one step for attn_block, checked once and shared by every layer.

    Row r is the token at position pos[r] of a sequence whose position p lives in cache slot
    slot_tables[r][p] (int64; positions 0..pos[r] reserved, earlier ones filled), and in windowed layers in
    slot ring_tables[r][p] (default: the same tables); rope_cos / rope_sin [positions > max(pos), head_dim / 2]
    float32.
    """

    def __init__(self, slot_tables: list[torch.Tensor], pos: torch.Tensor, rope_cos: torch.Tensor,
                 rope_sin: torch.Tensor, ring_tables: list[torch.Tensor] | None = None):
        B = len(slot_tables)
        if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.shape != (B,) or B == 0:
            raise ValueError(f"pos must be int64 [{B}] (one position per slot table)")
        plist = pos.tolist()
        ring_tables = slot_tables if ring_tables is None else ring_tables
        if len(ring_tables) != B:
            raise ValueError(f"{len(ring_tables)} ring tables for {B} rows")
        _check_rows(slot_tables, ring_tables, plist, rope_cos, rope_sin)
        self.B, self.pos, self.cos, self.sin = B, pos.contiguous(), rope_cos, rope_sin
        self.tables, self._plist, self._max = (slot_tables, ring_tables), plist, None
        self.slots = torch.tensor([t.data_ptr() for t in slot_tables], dtype=torch.int64)
        self.wslots = torch.tensor([t.data_ptr() for t in ring_tables], dtype=torch.int64)

    @property
    def max_slot(self) -> int:
        """The highest slot the slot tables name (positions 0..pos[r]), for attn_block's check of a cache's size
        (decode_layers checks in C)."""
        return self._maxes()[0]

    @property
    def max_wslot(self) -> int:
        return self._maxes()[1]

    def _maxes(self) -> tuple[int, int]:
        if self._max is None:
            self._max = tuple(_max_slot(tables, self._plist) for tables in self.tables)
        return self._max


def _max_slot(tables: list[torch.Tensor], plist: list[int]) -> int:
    used = [t[: p + 1] for t, p in zip(tables, plist)]
    if min(int(u.min()) for u in used) < 0:
        raise ValueError("negative cache slot")
    return max(int(u.max()) for u in used)


def attn_block(layer: AttnLayer, x: torch.Tensor, rows: AttnRows, k_cache: torch.Tensor, v_cache: torch.Tensor,
               eps: float, clip: float | None = None, *, moe: bool = False, isa: str | None = None):
    """The attention half of a layer for rows.B rows (see kernels/csrc/attn.h), x [B, hidden] updated in
    place. k_cache / v_cache: this layer's [slots, ...] cache holding every slot the rows' tables name, float32
    or float16 of kv_heads x head_dim values a slot, or uint8 of the same values in Q8_0 blocks (KV_Q8_0_BYTES
    per 32; head_dim a multiple of 32). Returns (xn [B, hidden]: ffn_norm of the new x, ids [B, k] int64,
    weights [B, k] float32), the last two None for a dense layer. moe=True (a layer built with its experts): x
    also gets the routed experts' output, so the whole layer is done."""
    isa_id = _isa(isa)
    _check_step(layer.hidden, x, rows, k_cache, v_cache)
    kt, vt = _check_cache(layer.kv_dim, rows, k_cache, v_cache, layer.window)
    if moe and not layer.whole:
        raise ValueError("moe=True needs a layer built with its experts")
    B = rows.B
    xn = torch.empty_like(x)
    k = layer.n_used if layer.routed else 1
    ids, w = torch.empty((B, k), dtype=torch.int64), torch.empty((B, k), dtype=torch.float32)
    slots = rows.wslots if layer.window else rows.slots
    _cpu.attn_block(isa_id, layer.desc.data_ptr(), x.data_ptr(), B, slots.data_ptr(), rows.pos.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), rows.cos.data_ptr(), rows.sin.data_ptr(), eps,
                    clip or 0.0, xn.data_ptr(), ids.data_ptr(), w.data_ptr(), int(moe), kt, vt)
    return (xn, ids, w) if layer.routed else (xn, None, None)


class LayerStack:
    """Consecutive whole layers (AttnLayers built with their experts) for decode_layers, checked once."""

    def __init__(self, layers: list[AttnLayer]):
        if not layers or not all(isinstance(la, AttnLayer) and la.whole for la in layers):
            raise ValueError("a LayerStack takes AttnLayers built with their experts")
        first = layers[0]
        if any((la.hidden, la.kv_dim, la.n_used) != (first.hidden, first.kv_dim, first.n_used) for la in layers):
            raise ValueError("the layers of a stack must share hidden size, KV width and experts per token")
        self.layers, self.hidden, self.kv_dim, self.n_used = layers, first.hidden, first.kv_dim, first.n_used
        self.addrs = torch.tensor([la.desc.data_ptr() for la in layers], dtype=torch.int64)
        self.bound: _Bound | None = None  # decode_layers' last caches and head, checked


class _Bound:
    """A LayerStack's binding to its layers' KV caches and head, checked once and kept on the stack, so that a
    decode step is one call with little Python around it: after a step has streamed the weights through the
    caches, every Python and torch operation runs from cold caches (~5x its warm time; ~0.9 ms of a 13 ms a3b-L12
    token went to the checks and tensors made around the call before). It holds the caches by weak reference:
    the same tensor objects, still alive, mean the same memory; anything else binds anew."""

    def __init__(self, stack: LayerStack, caches: list[tuple[torch.Tensor, torch.Tensor]], head: Head | None):
        n = len(stack.layers)
        if len(caches) != n:
            raise ValueError(f"{len(caches)} caches for the stack's {n} layers")
        if head is not None and head.hidden != stack.hidden:
            raise ValueError(f"the head takes {head.hidden} features, the layers give {stack.hidden}")
        types, held = set(), {False: [], True: []}
        for la, (kc, vc) in zip(stack.layers, caches):
            for name, t in (("k_cache", kc), ("v_cache", vc)):
                if not isinstance(t, torch.Tensor) or t.dtype not in KV_GGML_TYPES or not t.is_cpu or \
                        not t.is_contiguous():
                    raise ValueError(f"{name} must be a contiguous float32, float16 or uint8 (Q8_0) CPU tensor")
            types.add(_check_cache(stack.kv_dim, None, kc, vc))
            held[bool(la.window)].append(min(kc.shape[0], vc.shape[0]))
        if len(types) != 1:
            raise ValueError(f"the stack's caches must be of one type, got {sorted(types)}")
        self.kt, self.vt = types.pop()
        self.nslots, self.nwslots = (min(held[w], default=0) for w in (False, True))
        self.refs = [weakref.ref(t) for pair in caches for t in pair]
        self.head = head
        self.kcs = torch.tensor([kc.data_ptr() for kc, _ in caches], dtype=torch.int64)
        self.vcs = torch.tensor([vc.data_ptr() for _, vc in caches], dtype=torch.int64)
        self.tail = (0, 0, 0, 0) if head is None else (head.norm.data_ptr(), head.data.data_ptr(), head.type, head.rows)
        self.scratch: dict[int, tuple[torch.Tensor, ...]] = {}  # B -> xn, ids, w: written and read within a call

    def fits(self, caches, head) -> bool:
        return (head is self.head and len(caches) * 2 == len(self.refs)
                and all(r() is t for r, t in zip(self.refs, (t for pair in caches for t in pair))))


def decode_layers(stack: LayerStack, x: torch.Tensor, rows: AttnRows, caches: list[tuple[torch.Tensor, torch.Tensor]],
                  eps: float, clip: float | None = None, head: Head | None = None, *,
                  isa: str | None = None) -> torch.Tensor:
    """Every layer of the stack, whole (attention and routed experts), on rows.B rows: x [B, hidden] updated in
    place and returned, or with `head` the logits [B, head.rows] float32 of the result.
    caches: layer l's (k, v) [slots, kv_heads, head_dim] float32, float16 or Q8_0 (a windowed layer's indexed by
    the rows' ring tables). The stack keeps what it checked of the caches and head for the next call with the same
    ones (a pool hands out the same cache views each step); the slots the rows name are checked in C."""
    isa_id = _isa(isa)
    bound = stack.bound
    if bound is None or not bound.fits(caches, head):
        bound = stack.bound = _Bound(stack, caches, head)
    B = rows.B
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous()
            and x.shape == (B, stack.hidden)):
        _check_x(x, "x")
        raise ValueError(f"x {tuple(x.shape)} must be [{B}, {stack.hidden}]")
    scratch = bound.scratch.get(B)
    if scratch is None:
        scratch = bound.scratch[B] = (torch.empty((B, stack.hidden)), torch.empty((B, stack.n_used), dtype=torch.int64),
                                      torch.empty((B, stack.n_used)))
    xn, ids, w = scratch[:3]
    logits = None if head is None else torch.empty((B, head.rows))
    _cpu.decode_layers(isa_id, len(stack.layers), stack.addrs.data_ptr(), x.data_ptr(), B, rows.slots.data_ptr(),
                       rows.wslots.data_ptr(), rows.pos.data_ptr(), bound.kcs.data_ptr(), bound.vcs.data_ptr(),
                       rows.cos.data_ptr(), rows.sin.data_ptr(), eps, clip or 0.0, xn.data_ptr(), ids.data_ptr(),
                       w.data_ptr(), *bound.tail, 0 if logits is None else logits.data_ptr(), bound.kt, bound.vt,
                       bound.nslots, bound.nwslots, 0, 0, 0, 0, 0)
    return x if logits is None else logits


def decode_tokens(stack: LayerStack, embd: Embedding, tokens: list[int], pos: list[int],
                  slot_tables: list[torch.Tensor], ring_tables: list[torch.Tensor], rope_cos: torch.Tensor,
                  rope_sin: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], eps: float,
                  clip: float | None, head: Head, threads: int = 0, *, isa: str | None = None) -> torch.Tensor:
    """A whole small step from token ids to logits in one call: embd's rows for tokens (B ints), every layer of
    the stack (row r at position pos[r] of the sequence whose slots slot_tables[r] / ring_tables[r] hold, as
    AttnRows says), then the head -> logits [B, head.rows] float32. What decode_layers(..., head) gives on the
    looked-up embeddings, with nothing built in torch but the logits (each torch operation after a step runs
    from cold caches). threads > 0: the kernel pool runs the call on that many threads."""
    isa_id = _isa(isa)
    bound = stack.bound
    if bound is None or not bound.fits(caches, head):
        bound = stack.bound = _Bound(stack, caches, head)
    B = len(tokens)
    if head is None or not isinstance(embd, Embedding) or embd.hidden != stack.hidden:
        raise ValueError("decode_tokens needs the model's head and an Embedding of the stack's width")
    if B == 0 or len(pos) != B or len(slot_tables) != B or len(ring_tables) != B:
        raise ValueError(f"{B} tokens need as many positions and slot tables (at least one)")
    _check_rows(slot_tables, ring_tables, pos, rope_cos, rope_sin)
    scratch = bound.scratch.get(B)
    if scratch is None or len(scratch) < 4:
        scratch = bound.scratch[B] = (torch.empty((B, stack.hidden)), torch.empty((B, stack.n_used), dtype=torch.int64),
                                      torch.empty((B, stack.n_used)), torch.empty((B, stack.hidden)))
    xn, ids, w, x = scratch
    toks, where = array("q", tokens), array("q", pos)
    slots = array("Q", [t.data_ptr() for t in slot_tables])
    wslots = array("Q", [t.data_ptr() for t in ring_tables])
    logits = torch.empty((B, head.rows))
    _cpu.decode_layers(isa_id, len(stack.layers), stack.addrs.data_ptr(), x.data_ptr(), B, slots.buffer_info()[0],
                       wslots.buffer_info()[0], where.buffer_info()[0], bound.kcs.data_ptr(), bound.vcs.data_ptr(),
                       rope_cos.data_ptr(), rope_sin.data_ptr(), eps, clip or 0.0, xn.data_ptr(), ids.data_ptr(),
                       w.data_ptr(), *bound.tail, logits.data_ptr(), bound.kt, bound.vt, bound.nslots, bound.nwslots,
                       embd.data.data_ptr(), embd.type, embd.rows, toks.buffer_info()[0], max(0, threads))
    return logits


def head_logits(head: Head, x: torch.Tensor, eps: float, *, isa: str | None = None) -> torch.Tensor:
    """rms_norm(x [T, hidden], head.norm) @ head.weight^T -> logits [T, head.rows] float32 (the computation
    decode_layers ends with, for steps that do not run whole)."""
    isa_id = _isa(isa)
    _check_x(x, "x")
    if x.shape[1] != head.hidden:
        raise ValueError(f"x has {x.shape[1]} features, the head takes {head.hidden}")
    T = x.shape[0]
    xn, logits = torch.empty_like(x), torch.empty((T, head.rows), dtype=torch.float32)
    if T:
        _cpu.head(isa_id, x.data_ptr(), T, head.hidden, head.norm.data_ptr(), eps, head.data.data_ptr(), head.type,
                  head.rows, xn.data_ptr(), logits.data_ptr())
    return logits


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


def _check_step(hidden: int, x, rows: AttnRows, k_cache, v_cache) -> None:
    _check_x(x, "x")
    if x.shape != (rows.B, hidden):
        raise ValueError(f"x {tuple(x.shape)} must be [{rows.B}, {hidden}]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in KV_GGML_TYPES or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32, float16 or uint8 (Q8_0) CPU tensor")


KV_GGML_TYPES = {torch.float32: 0, torch.float16: 1, torch.uint8: 8}  # a cache's storage -> its ggml type id
KV_Q8_0_BYTES = 34  # a Q8_0 block: an f16 scale and 32 int8


def _check_cache(kv_dim: int, rows: AttnRows | None, k_cache, v_cache, window: int = 0) -> tuple[int, int]:
    """One layer's caches: kv_dim values for each slot its tables (a windowed layer's: the rings) name (rows None:
    at least one slot) -> their ggml type ids."""
    top = 0 if rows is None else rows.max_wslot if window else rows.max_slot
    out = []
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        want = kv_dim // 32 * KV_Q8_0_BYTES if t.dtype == torch.uint8 else kv_dim
        if t.dim() < 1 or t[0].numel() != want or t.shape[0] <= top or (t.dtype == torch.uint8 and kv_dim % 32):
            raise ValueError(f"{name} must be a contiguous CPU tensor of {kv_dim} values (float32, float16 or Q8_0 "
                             f"blocks) for each of > {top} slots")
        out.append(KV_GGML_TYPES[t.dtype])
    return tuple(out)


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
