"""Whole decoder layers in C for small steps (decode, speculative verification): moerun/kernels/csrc/attn.h's layer
descriptor built and checked once per layer, a step's rows, and the calls that run one layer (attn_block) or a
run of layers from token ids to logits (decode_layers, decode_tokens).

    layer = Layer(hidden=H, attn_norm=..., ffn_norm=..., attention=Attention(...), router=..., experts=...)
    stack = LayerStack([layer, ...])
    logits = decode_tokens(stack, Embedding(table, H), tokens, pos, slot_tables, ring_tables, cos, sin, caches,
                           eps, clip, Head(norm, head, H), state_slots=...)

A layer is a mixer (grouped-query attention with its variants, or gated DeltaNet) then an FFN (routed experts with
a shared expert beside them, or a dense FFN), each on its normed input with a residual.
"""

from __future__ import annotations

import math
import weakref
from array import array
from dataclasses import dataclass

import torch

from moerun.kernels.cpu import FLOAT_TYPES, _check_q, _check_x, _cpu, _fn_args, _isa, _need, _type
from moerun.quant.qtypes import QTensor

__all__ = ["Attention", "AttnRows", "DeltaNet", "Embedding", "Head", "LatentAttention", "Layer", "LayerStack",
           "attn_block", "decode_layers", "decode_tokens", "head_logits"]

GATINGS = {"softmax": 0, "topk_softmax": 1, "sigmoid": 2}  # attn.h's gating
GROUP_SCORES = {"max": 0, "top2": 1}
KV_GGML_TYPES = {torch.float32: 0, torch.float16: 1, torch.uint8: 8}  # a cache's storage -> its ggml type id
KV_Q8_0_BYTES = 34  # a Q8_0 block: an f16 scale and 32 int8


@dataclass(frozen=True)
class Attention:
    """A layer's grouped-query attention: weights and variants (attn.h). rope_dim: the rotated dimensions of each
    head (0: all); gate: wq gives each head's q then its output gate; scale: the softmax's (0: head_dim ** -0.5)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    wq: object
    wk: object
    wv: object
    wo: object
    qk_norm: str | None = None  # None, "full", "head"
    rope_style: str = "neox"
    rope_dim: int = 0
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    window: int = 0
    gate: bool = False
    scale: float = 0.0


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (attn.h's kind 2, absorbed): heads of nope + rope query dimensions;
    wq [heads * (nope + rope), hidden], or with wq_a ([q_rank, hidden]) and q_a_norm wq [.., q_rank]; wkv_a
    [rank + rope, hidden] and kv_a_norm [rank] make the cached latent; wk_b [heads, rank, nope] and wv_b [heads,
    v_dim, rank] float32, or QTensors in GGUF's layout of a type cpu.has_deq_dot takes; wo [hidden, heads * v_dim];
    scale: the softmax's (0: (nope + rope) ** -0.5)."""

    n_heads: int
    nope: int
    rope: int
    rank: int
    v_dim: int
    wq: object
    wkv_a: object
    kv_a_norm: torch.Tensor
    wk_b: object
    wv_b: object
    wo: object
    wq_a: object = None
    q_a_norm: torch.Tensor | None = None
    rope_style: str = "interleaved"
    scale: float = 0.0


@dataclass(frozen=True)
class DeltaNet:
    """A layer's gated DeltaNet (attn.h's ssm_* fields): beta and alpha from `ba` ([b (r), a (r)] per key head) or
    from `beta` and `alpha`; conv [C, K] float32; a, dt [nv]; norm [dv]; tiled: value head h reads key head h % nk."""

    n_k_heads: int
    n_v_heads: int
    k_dim: int
    v_dim: int
    qkv: object
    z: object
    out: object
    conv: torch.Tensor
    a: torch.Tensor
    dt: torch.Tensor
    norm: torch.Tensor
    ba: object = None
    beta: object = None
    alpha: object = None
    tiled: bool = False


class Layer:
    """One layer's constant part for attn_block: its weights' addresses, types and shapes, checked once.

    Weights are QTensors of a supported type or contiguous float32 tensors; norms and biases float32 vectors. The
    object keeps references to everything it points to. The mixer: `attention` or `delta`. The FFN: router=None
    and `dense` (gate, up, down) for a dense layer; else routed experts: `experts` the stacked (gate [E, I, H],
    up [E, I, H], down [E, H, I]) QTensors, for calls that finish the whole layer (attn_block(..., moe=True),
    decode_layers); router_b the router's bias; gating "softmax", "topk_softmax" or "sigmoid" (score_b a correction
    bias for choosing, n_groups / topk_groups / group_score the group limit, routed_scale); fn the experts'
    activation and biases (as moe_ffn's); `shared` (gate, up, down) a shared expert beside them, scaled by
    sigmoid(x . shared_gate) when that [hidden] vector is given.
    """

    def __init__(self, *, hidden: int, attn_norm, ffn_norm, attention: Attention | LatentAttention | None = None,
                 delta: DeltaNet | None = None, router=None, n_used: int = 0, norm_topk: bool = False, experts=None,
                 router_b=None, gating: str = "softmax", fn=None, score_b=None, n_groups: int = 1,
                 topk_groups: int = 1, group_score: str = "max", routed_scale: float = 1.0, shared=None,
                 shared_gate=None, dense=None):
        _need()
        if (attention is None) == (delta is None):
            raise ValueError("a layer has one mixer: attention or delta")
        if gating not in GATINGS or group_score not in GROUP_SCORES:
            raise ValueError(f"gating {gating!r} not in {list(GATINGS)} or group score {group_score!r} not in "
                             f"{list(GROUP_SCORES)}")
        n_experts = 0 if router is None else router.shape[0]
        if router is not None and not (1 <= n_used <= n_experts and n_groups >= 1 and n_experts % n_groups == 0
                                       and 1 <= topk_groups <= n_groups
                                       and topk_groups * (n_experts // n_groups) >= n_used):
            raise ValueError(f"{n_used} of {n_experts} experts in {topk_groups} of {n_groups} groups: not supported")
        self._keep: list = []
        self.fparams = torch.tensor([routed_scale, attention.scale if attention else 0.0], dtype=torch.float32)
        f = {"hidden": hidden, "fparams": self.fparams.data_ptr(), "gating": GATINGS[gating],
             "n_groups": n_groups, "topk_groups": topk_groups, "group_score": GROUP_SCORES[group_score],
             "n_experts": n_experts, "n_used": n_used, "norm_topk": int(norm_topk)}
        for name, t, n in (("attn_norm", attn_norm, hidden), ("ffn_norm", ffn_norm, hidden),
                           ("router_b", router_b, n_experts or None), ("score_b", score_b, n_experts or None),
                           ("sh_gate_inp", None if shared_gate is None else shared_gate.reshape(-1), hidden)):
            f[name] = self._vector(name, t, n)
        f["router"], f["router_type"] = (0, 0) if router is None else self._matrix("router", router,
                                                                                  (n_experts, hidden))
        latent = isinstance(attention, LatentAttention)
        f.update(self._latent(attention, hidden) if latent else
                 self._attention(attention, hidden) if attention else self._delta(delta, hidden))
        f.update(self._experts(experts, n_experts, hidden))
        f.update(self._fn(fn, n_experts, f["n_ff"], hidden))
        f.update(self._shared(dense if router is None else shared, hidden))
        self.desc = torch.tensor([f.get(name, 0) for name in _cpu.attn_fields()], dtype=torch.int64)
        self.hidden, self.n_used, self.routed = hidden, n_used, router is not None
        self.kind, a = "mla" if latent else "attention" if attention else "delta", attention
        self.kv_dim = (a.rank + a.rope if latent else a.n_kv_heads * a.head_dim) if a else 0
        self.rope_half = ((a.rope if latent else a.rope_dim or a.head_dim) if a else 0) // 2
        self.window = a.window if a and not latent else 0
        self.state = (delta.conv.shape, (delta.n_v_heads, delta.k_dim, delta.v_dim)) if delta else None
        # the call can finish the FFN: the routed experts given (with the shared expert, if any), or a dense FFN
        self.whole = experts is not None if router is not None else dense is not None

    def _attention(self, a: Attention, hidden: int) -> dict[str, int]:
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        R = a.rope_dim or a.head_dim
        if a.n_heads % a.n_kv_heads or a.head_dim % 2 or R % 2 or R > a.head_dim or a.window < 0:
            raise ValueError(f"{a.n_heads} heads over {a.n_kv_heads} KV heads of dim {a.head_dim} (rotary {R}, "
                             f"window {a.window}): not supported")
        f = {"kind": 0, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim,
             "qk_norm": {None: 0, "full": 1, "head": 2}[a.qk_norm], "neox": int(a.rope_style == "neox"),
             "rope_dim": R, "attn_gate": int(a.gate), "window": a.window}
        norm_len = {"full": (q_dim, kv_dim), "head": (a.head_dim, a.head_dim)}.get(a.qk_norm, (None, None))
        for name, t, n in (("q_norm", a.q_norm, norm_len[0]), ("k_norm", a.k_norm, norm_len[1]),
                           ("bq", a.bq, q_dim), ("bk", a.bk, kv_dim), ("bv", a.bv, kv_dim), ("bo", a.bo, hidden),
                           ("sinks", a.sinks, a.n_heads)):
            f[name] = self._vector(name, t, n)
        for name, w, shape in (("wq", a.wq, ((1 + a.gate) * q_dim, hidden)), ("wk", a.wk, (kv_dim, hidden)),
                               ("wv", a.wv, (kv_dim, hidden)), ("wo", a.wo, (hidden, q_dim))):
            f[name], f[name + "_type"] = self._matrix(name, w, shape)
        return f

    def _latent(self, a: LatentAttention, hidden: int) -> dict[str, int]:
        hd, L, qr = a.nope + a.rope, a.rank + a.rope, 0 if a.wq_a is None else a.wq_a.shape[0]
        if min(a.n_heads, a.nope, a.rank, a.v_dim) < 1 or a.rope < 2 or a.rope % 2 or (a.wq_a is None) != \
                (a.q_a_norm is None):
            raise ValueError("a latent attention layer's shapes are not supported")
        f = {"kind": 2, "n_heads": a.n_heads, "n_kv_heads": 1, "head_dim": hd, "rope_dim": a.rope,
             "neox": int(a.rope_style == "neox"), "mla_rank": a.rank, "mla_v": a.v_dim, "q_rank": qr}
        for name, t, n in (("kv_a_norm", a.kv_a_norm, a.rank), ("q_a_norm", a.q_a_norm, qr or None)):
            f[name] = self._vector(name, t, n)
        for name, w, shape in (("wk_b", a.wk_b, (a.n_heads, a.rank, a.nope)),
                               ("wv_b", a.wv_b, (a.n_heads, a.v_dim, a.rank))):
            if isinstance(w, QTensor) and w.interleave == 1:  # read in its type (deqdot.c)
                f[name], f[name + "_type"] = self._matrix(name, w, shape)
            else:
                f[name] = self._vector(name, w.reshape(-1) if isinstance(w, torch.Tensor) else w, math.prod(shape))
        mats = [("wq", a.wq, (a.n_heads * hd, qr or hidden)), ("wkv_a", a.wkv_a, (L, hidden)),
                ("wo", a.wo, (hidden, a.n_heads * a.v_dim))] + ([("wq_a", a.wq_a, (qr, hidden))] if qr else [])
        for name, w, shape in mats:
            f[name], f[name + "_type"] = self._matrix(name, w, shape)
        return f

    def _delta(self, d: DeltaNet, hidden: int) -> dict[str, int]:
        nk, nv, dk, dv = d.n_k_heads, d.n_v_heads, d.k_dim, d.v_dim
        C, Z = 2 * nk * dk + nv * dv, nv * dv
        if min(nk, nv, dk, dv) < 1 or nv % nk or dk > 1024 or dv > 1024 or d.conv.dim() != 2 or \
                d.conv.shape[0] != C or (d.ba is None) == (d.beta is None or d.alpha is None):
            raise ValueError("a DeltaNet layer's shapes are not supported")
        f = {"kind": 1, "ssm_k": d.conv.shape[1], "ssm_nk": nk, "ssm_nv": nv, "ssm_dk": dk, "ssm_dv": dv,
             "ssm_tiled": int(d.tiled)}
        for name, t, n in (("ssm_conv", d.conv.reshape(-1), C * d.conv.shape[1]), ("ssm_a", d.a, nv),
                           ("ssm_dt", d.dt, nv), ("ssm_norm", d.norm, dv)):
            f[name] = self._vector(name, t, n)
        mats = [("ssm_qkv", d.qkv, (C, hidden)), ("ssm_z", d.z, (Z, hidden)), ("ssm_out", d.out, (hidden, Z))]
        mats += [("ssm_ba", d.ba, (2 * nv, hidden))] if d.ba is not None else \
            [("ssm_beta", d.beta, (nv, hidden)), ("ssm_alpha", d.alpha, (nv, hidden))]
        for name, w, shape in mats:
            f[name], f[name + "_type"] = self._matrix(name, w, shape)
        return f

    def _shared(self, ffn, hidden: int) -> dict[str, int]:
        if ffn is None:
            return {}
        gate, up, down = ffn
        F = gate.shape[0]
        f = {"sh_ff": F}
        for name, w, shape in (("sh_gate", gate, (F, hidden)), ("sh_up", up, (F, hidden)),
                               ("sh_down", down, (hidden, F))):
            f[name], f[name + "_type"] = self._matrix(name, w, shape)
        return f

    def _fn(self, fn, E: int, I: int, H: int) -> dict[str, int]:
        if fn is None:
            return {}
        act, alpha, limit, gb, ub, db = _fn_args(fn, E, I, H)
        params = torch.tensor([alpha, limit], dtype=torch.float32)
        self._keep += [params, *(fn.biases or ())]
        return {"act": act, "act_params": params.data_ptr(), "gate_b": gb, "up_b": ub, "down_b": db}

    def _experts(self, experts, E: int, H: int) -> dict[str, int]:
        if experts is None:
            return {"n_ff": 0}
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
    """(the bytes the kernels read, their type id) of a matrix (or stack): a supported QTensor or float32 tensor."""
    if isinstance(w, QTensor):
        _check_q(w, name, len(shape))
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
    slot ring_tables[r][p] (default: the same tables), and whose DeltaNet layers' state is slot state_slots[r] of
    theirs; rope_cos / rope_sin [positions > max(pos), rotary dims / 2] float32.
    """

    def __init__(self, slot_tables: list[torch.Tensor], pos: torch.Tensor, rope_cos: torch.Tensor,
                 rope_sin: torch.Tensor, ring_tables: list[torch.Tensor] | None = None,
                 state_slots: list[int] | None = None):
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
        if state_slots is not None and len(state_slots) != B:
            raise ValueError(f"{len(state_slots)} state slots for {B} rows")
        self.sslots = None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64)

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


def attn_block(layer: Layer, x: torch.Tensor, rows: AttnRows, k_cache: torch.Tensor, v_cache: torch.Tensor,
               eps: float, clip: float | None = None, *, moe: bool = False, isa: str | None = None):
    """One layer's mixer for rows.B rows (see moerun/kernels/csrc/attn.h), x [B, hidden] updated in place. k_cache /
    v_cache: an attention layer's [slots, ...] cache holding every slot the rows' tables name, float32 or float16 of
    kv_heads x head_dim values a slot, or uint8 of the same values in Q8_0 blocks (KV_Q8_0_BYTES per 32; head_dim a
    multiple of 32); a DeltaNet layer's conv and ssm states (float32 [states, C, K - 1] and [states, nv, dk, dv],
    the rows' at rows.sslots). Returns (xn [B, hidden]: ffn_norm of the new x, ids [B, k] int64, weights [B, k]
    float32), the last two None for a dense layer. moe=True (a whole layer): the FFN is done too."""
    isa_id = _isa(isa)
    _check_x(x, "x")
    if x.shape != (rows.B, layer.hidden):
        raise ValueError(f"x {tuple(x.shape)} must be [{rows.B}, {layer.hidden}]")
    if moe and not layer.whole:
        raise ValueError("moe=True needs a layer built with its experts")
    kt = vt = 0
    nstates = 0
    if layer.kind == "delta":
        nstates = _check_state(layer, k_cache, v_cache)
        if rows.sslots is None:
            raise ValueError("a DeltaNet layer needs the rows' state slots")
    else:
        v_cache = k_cache if layer.kind == "mla" else v_cache  # the latent is keys and values at once
        _check_kv(k_cache, v_cache)
        kt, vt = _check_cache(layer.kv_dim, rows, k_cache, v_cache, layer.window)
        _check_rope(layer.rope_half, rows.cos)
    B = rows.B
    xn = torch.empty_like(x)
    k = layer.n_used if layer.routed else 1
    ids, w = torch.empty((B, k), dtype=torch.int64), torch.empty((B, k), dtype=torch.float32)
    slots = rows.wslots if layer.window else rows.slots
    _cpu.attn_block(isa_id, layer.desc.data_ptr(), x.data_ptr(), B, slots.data_ptr(), rows.pos.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), rows.cos.data_ptr(), rows.sin.data_ptr(), eps,
                    clip or 0.0, xn.data_ptr(), ids.data_ptr(), w.data_ptr(), int(moe), kt, vt,
                    0 if rows.sslots is None else rows.sslots.data_ptr(), nstates)
    return (xn, ids, w) if layer.routed else (xn, None, None)


class LayerStack:
    """Consecutive whole layers (Layers that finish their FFN) for decode_layers, checked once."""

    def __init__(self, layers: list[Layer]):
        if not layers or not all(isinstance(la, Layer) and la.whole for la in layers):
            raise ValueError("a LayerStack takes whole Layers (built with their experts)")
        first = layers[0]
        attn = [la for la in layers if la.kind != "delta"]
        if any(la.hidden != first.hidden for la in layers) or len({(la.kv_dim, la.rope_half) for la in attn}) > 1:
            raise ValueError("the layers of a stack must share hidden size, and their attention KV width and RoPE")
        self.layers, self.hidden = layers, first.hidden
        self.kv_dim, self.rope_half = (attn[0].kv_dim, attn[0].rope_half) if attn else (0, 0)
        self.n_used = max(1, max(la.n_used for la in layers))
        self.linear = any(la.kind == "delta" for la in layers)
        self.addrs = torch.tensor([la.desc.data_ptr() for la in layers], dtype=torch.int64)
        self.bound: _Bound | None = None  # decode_layers' last caches and head, checked


class _Bound:
    """A LayerStack's binding to its layers' KV caches (or states) and head, checked once and kept on the stack, so
    that a decode step is one call with little Python around it: after a step has streamed the weights through the
    caches, every Python and torch operation runs from cold caches (~5x its warm time; ~0.9 ms of a 13 ms a3b-L12
    token went to the checks and tensors made around the call before). It holds the caches by weak reference:
    the same tensor objects, still alive, mean the same memory; anything else binds anew."""

    def __init__(self, stack: LayerStack, caches: list[tuple[torch.Tensor, torch.Tensor]], head: Head | None):
        n = len(stack.layers)
        if len(caches) != n:
            raise ValueError(f"{len(caches)} caches for the stack's {n} layers")
        if head is not None and head.hidden != stack.hidden:
            raise ValueError(f"the head takes {head.hidden} features, the layers give {stack.hidden}")
        types, held, states = set(), {False: [], True: []}, []
        for la, (kc, vc) in zip(stack.layers, caches):
            if la.kind == "delta":
                states.append(_check_state(la, kc, vc))
                continue
            vc = kc if la.kind == "mla" else vc
            _check_kv(kc, vc)
            types.add(_check_cache(stack.kv_dim, None, kc, vc))
            held[bool(la.window)].append(min(kc.shape[0], vc.shape[0]))
        if len(types) > 1:
            raise ValueError(f"the stack's caches must be of one type, got {sorted(types)}")
        self.kt, self.vt = types.pop() if types else (0, 0)
        self.nslots, self.nwslots = (min(held[w], default=0) for w in (False, True))
        self.nstates = min(states, default=0)
        self.refs = [weakref.ref(t) for pair in caches for t in pair]
        self.head = head
        self.kcs = torch.tensor([kc.data_ptr() for kc, _ in caches], dtype=torch.int64)
        self.vcs = torch.tensor([vc.data_ptr() for _, vc in caches], dtype=torch.int64)
        self.tail = (0, 0, 0, 0) if head is None else (head.norm.data_ptr(), head.data.data_ptr(), head.type, head.rows)
        self.scratch: dict[int, tuple[torch.Tensor, ...]] = {}  # B -> xn, ids, w, x: written and read within a call

    def fits(self, caches, head) -> bool:
        return (head is self.head and len(caches) * 2 == len(self.refs)
                and all(r() is t for r, t in zip(self.refs, (t for pair in caches for t in pair))))

    def buffers(self, stack: LayerStack, B: int) -> tuple[torch.Tensor, ...]:
        got = self.scratch.get(B)
        if got is None:
            got = self.scratch[B] = (torch.empty((B, stack.hidden)), torch.empty((B, stack.n_used), dtype=torch.int64),
                                     torch.empty((B, stack.n_used)), torch.empty((B, stack.hidden)))
        return got


def _bind(stack: LayerStack, caches, head: Head | None) -> _Bound:
    bound = stack.bound
    if bound is None or not bound.fits(caches, head):
        bound = stack.bound = _Bound(stack, caches, head)
    return bound


def decode_layers(stack: LayerStack, x: torch.Tensor, rows: AttnRows, caches: list[tuple[torch.Tensor, torch.Tensor]],
                  eps: float, clip: float | None = None, head: Head | None = None, *,
                  isa: str | None = None) -> torch.Tensor:
    """Every layer of the stack, whole, on rows.B rows: x [B, hidden] updated in place and returned, or with `head`
    the logits [B, head.rows] float32 of the result.
    caches: layer l's (k, v) [slots, kv_heads, head_dim] float32, float16 or Q8_0 (a windowed layer's indexed by
    the rows' ring tables), or a DeltaNet layer's (conv, ssm) states. The stack keeps what it checked of the caches
    and head for the next call with the same ones (a pool hands out the same cache views each step); the slots the
    rows name are checked in C."""
    isa_id = _isa(isa)
    bound = _bind(stack, caches, head)
    B = rows.B
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous()
            and x.shape == (B, stack.hidden)):
        _check_x(x, "x")
        raise ValueError(f"x {tuple(x.shape)} must be [{B}, {stack.hidden}]")
    if stack.linear and rows.sslots is None:
        raise ValueError("a stack with DeltaNet layers needs the rows' state slots")
    _check_rope(stack.rope_half, rows.cos)
    xn, ids, w, _ = bound.buffers(stack, B)
    logits = None if head is None else torch.empty((B, head.rows))
    _cpu.decode_layers(isa_id, len(stack.layers), stack.addrs.data_ptr(), x.data_ptr(), B, rows.slots.data_ptr(),
                       rows.wslots.data_ptr(), rows.pos.data_ptr(), bound.kcs.data_ptr(), bound.vcs.data_ptr(),
                       rows.cos.data_ptr(), rows.sin.data_ptr(), eps, clip or 0.0, xn.data_ptr(), ids.data_ptr(),
                       w.data_ptr(), *bound.tail, 0 if logits is None else logits.data_ptr(), bound.kt, bound.vt,
                       bound.nslots, bound.nwslots, 0, 0, 0, 0, 0,
                       0 if rows.sslots is None else rows.sslots.data_ptr(), bound.nstates)
    return x if logits is None else logits


def decode_tokens(stack: LayerStack, embd: Embedding, tokens: list[int], pos: list[int],
                  slot_tables: list[torch.Tensor], ring_tables: list[torch.Tensor], rope_cos: torch.Tensor,
                  rope_sin: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], eps: float,
                  clip: float | None, head: Head, threads: int = 0, *, state_slots: list[int] | None = None,
                  isa: str | None = None) -> torch.Tensor:
    """A whole small step from token ids to logits in one call: embd's rows for tokens (B ints), every layer of
    the stack (row r at position pos[r] of the sequence whose slots slot_tables[r] / ring_tables[r] hold, and whose
    DeltaNet states are at state_slots[r], as AttnRows says), then the head -> logits [B, head.rows] float32. What
    decode_layers(..., head) gives on the looked-up embeddings, with nothing built in torch but the logits (each
    torch operation after a step runs from cold caches). threads > 0: the kernel pool runs the call on that many
    threads."""
    isa_id = _isa(isa)
    bound = _bind(stack, caches, head)
    B = len(tokens)
    if head is None or not isinstance(embd, Embedding) or embd.hidden != stack.hidden:
        raise ValueError("decode_tokens needs the model's head and an Embedding of the stack's width")
    if B == 0 or len(pos) != B or len(slot_tables) != B or len(ring_tables) != B:
        raise ValueError(f"{B} tokens need as many positions and slot tables (at least one)")
    if stack.linear and (state_slots is None or len(state_slots) != B):
        raise ValueError("a stack with DeltaNet layers needs a state slot for each row")
    _check_rows(slot_tables, ring_tables, pos, rope_cos, rope_sin)
    _check_rope(stack.rope_half, rope_cos)
    xn, ids, w, x = bound.buffers(stack, B)
    toks, where = array("q", tokens), array("q", pos)
    slots = array("Q", [t.data_ptr() for t in slot_tables])
    wslots = array("Q", [t.data_ptr() for t in ring_tables])
    sslots = array("q", state_slots or ())
    logits = torch.empty((B, head.rows))
    _cpu.decode_layers(isa_id, len(stack.layers), stack.addrs.data_ptr(), x.data_ptr(), B, slots.buffer_info()[0],
                       wslots.buffer_info()[0], where.buffer_info()[0], bound.kcs.data_ptr(), bound.vcs.data_ptr(),
                       rope_cos.data_ptr(), rope_sin.data_ptr(), eps, clip or 0.0, xn.data_ptr(), ids.data_ptr(),
                       w.data_ptr(), *bound.tail, logits.data_ptr(), bound.kt, bound.vt, bound.nslots, bound.nwslots,
                       embd.data.data_ptr(), embd.type, embd.rows, toks.buffer_info()[0], max(0, threads),
                       sslots.buffer_info()[0] if state_slots else 0, bound.nstates)
    return logits


def _check_rope(half: int, cos: torch.Tensor) -> None:
    if half and (cos.dim() != 2 or cos.shape[1] != half):
        raise ValueError(f"the RoPE tables must be [positions, {half}] (the rotated dimensions' half)")


def _check_kv(k_cache, v_cache) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dtype not in KV_GGML_TYPES or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32, float16 or uint8 (Q8_0) CPU tensor")


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


def _check_state(layer: Layer, conv, ssm) -> int:
    """A DeltaNet layer's states: conv [n, C, K - 1] and ssm [n, nv, dk, dv] float32 -> n."""
    (C, K), shape = layer.state
    for name, t, want in (("conv", conv, (C, K - 1)), ("ssm", ssm, shape)):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
                and tuple(t.shape[1:]) == tuple(want)):
            raise ValueError(f"the {name} state must be a contiguous float32 CPU tensor [states, {list(want)}]")
    if conv.shape[0] != ssm.shape[0]:
        raise ValueError("the conv and ssm states must hold as many slots")
    return conv.shape[0]
