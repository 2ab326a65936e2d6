"""Small steps (decode, speculative verification, prompt chunks of up to 16 rows) through whole layers in C
(moerun.kernels.layer): one kernel call per layer does the mixer (grouped-query or latent attention, or gated DeltaNet
over the pool's states), the routing and, when the experts are read where they are stored (no cache, no routing
hook), the FFN too (routed experts with the shared one, or a dense FFN); a run of such layers is one call, and a
whole model from token ids to logits is one call per step (`decode_tokens`). That takes the Python between
kernel calls out of a decode step (on V2-Lite's full depth 31.0 against the loop's 59.2 ms a token,
bench/journal/issue-36.md).

It applies when every weight it reads is a QTensor of a type the CPU kernels take, or float32, and the model
computes in float32 on the CPU (else `FusedAttention.build` returns None and the model keeps its torch path, which
stays the reference the tests compare with). DeepSeek's MLA runs absorbed (moerun/kernels/csrc/mla.c).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from moerun.arch.spec import RING_ROWS, ModelSpec
from moerun.model.layers import rope_tables
from moerun.model.ops import ExpertFn
from moerun.quant.qtypes import FLOAT_QTYPES, QTensor

if TYPE_CHECKING:
    from moerun.engine.kv_cache import SeqKV


class Model(Protocol):
    """What FusedAttention reads of the model it serves (moerun.model.model.MoEModel, which imports this module):
    the spec, the stage's layers [first, stop) and their weights, the head, the embeddings, ops and dtype."""

    spec: ModelSpec
    first: int
    stop: int
    layers: Sequence
    store: object  # ExpertStore: stacks(layer) for the whole layers' experts
    out_norm: torch.Tensor | None
    head: object | None
    embd: object | None
    ops: object
    dtype: torch.dtype


def _latent_map(cpu, stored: QTensor | None, floats: torch.Tensor):
    """MLA's W_UK or W_UV for the fused decode: the file's quantized bytes where this CPU dequantizes that type in
    registers (cpu.deq_dot: the float32 copy's products bit for bit, a quarter to an eighth of the bytes read),
    else the float32 copy the layer loop multiplies."""
    if (isinstance(stored, QTensor) and stored.qtype not in FLOAT_QTYPES and stored.interleave == 1
            and stored.data.is_cpu and cpu.has_deq_dot(stored.qtype)):
        return stored
    return floats.contiguous()


class FusedAttention:
    # above this (prefill chunks) torch's attention and GEMM paths are faster; a windowed layer's ring leaves room
    # for this many positions of one sequence written before they are attended to
    MAX_ROWS = RING_ROWS

    def __init__(self, model: Model, cpu, kl):
        s = model.spec
        self.cpu, self.kl, self.spec = cpu, kl, s

        def layer(i: int, lw):
            if s.linear(i):
                mixer = {"delta": kl.DeltaNet(
                    n_k_heads=s.ssm_k_heads, n_v_heads=s.ssm_v_heads, k_dim=s.ssm_k_dim, v_dim=s.ssm_v_dim,
                    qkv=lw.wqkv, z=lw.wz, out=lw.ssm_out, conv=lw.conv.contiguous(), a=lw.ssm_a, dt=lw.ssm_dt,
                    norm=lw.ssm_norm, ba=lw.wba, beta=lw.wbeta, alpha=lw.walpha, tiled=s.ssm_v_order == "tiled")}
            elif s.attention == "mla":
                mixer = {"attention": kl.LatentAttention(
                    n_heads=s.n_heads, nope=s.qk_nope_dim, rope=s.qk_rope_dim, rank=s.kv_lora_rank,
                    v_dim=s.v_head_dim, wq=lw.wq, wkv_a=lw.wkv_a, kv_a_norm=lw.kv_a_norm,
                    wk_b=_latent_map(cpu, lw.wk_b_q, lw.wk_b), wv_b=_latent_map(cpu, lw.wv_b_q, lw.wv_b), wo=lw.wo, wq_a=lw.wq_a, q_a_norm=lw.q_a_norm,
                    rope_style=s.rope_style, scale=s.softmax_scale)}
            else:
                mixer = {"attention": kl.Attention(
                    n_heads=s.n_heads, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, wq=lw.wq, wk=lw.wk, wv=lw.wv,
                    wo=lw.wo, qk_norm=None if s.qk_norm == "none" else s.qk_norm, rope_style=s.rope_style,
                    rope_dim=s.rotary_dim, q_norm=lw.q_norm, k_norm=lw.k_norm, bq=lw.bq, bk=lw.bk, bv=lw.bv,
                    bo=lw.bo, sinks=lw.sinks, window=s.sliding_window if s.sliding(i) else 0, gate=s.attn_gate,
                    scale=s.attn_scale)}
            fn = ExpertFn(s.expert_act, s.swiglu_alpha, s.swiglu_limit, lw.exp_b)
            make = partial(kl.Layer, hidden=s.hidden, attn_norm=lw.attn_norm, ffn_norm=lw.ffn_norm, router=lw.router,
                           router_b=lw.router_b, n_used=s.n_experts_used if lw.router is not None else 0,
                           norm_topk=s.norm_topk, gating=s.router, fn=None if fn.plain else fn, score_b=lw.score_b,
                           n_groups=s.n_groups, topk_groups=s.topk_groups, group_score=s.group_score,
                           routed_scale=s.routed_scale, shared_gate=lw.shexp_gate, **mixer)
            try:  # the whole layer: routed experts with the shared one, or the dense FFN
                stacks = model.store.stacks(i) if lw.router is not None else None
                return make(experts=stacks, shared=lw.shexp, dense=lw.ffn)
            except ValueError:  # experts or an FFN of a type or layout the kernels do not take: the mixer only
                return make()

        self.layers = [layer(i, lw) for i, lw in zip(range(model.first, model.stop), model.layers)]
        self.head = None  # the output norm and projection, when this model holds them and the kernels take them
        if model.stop == s.n_layers and model.head is not None:
            try:
                self.head = kl.Head(model.out_norm, model.head, s.hidden)
            except ValueError:
                pass
        # a small step can go from its embeddings to its logits in one call (decode_layers(..., logits=True))
        self.whole_model = (self.head is not None and model.first == 0 and len(self.layers) > 0
                            and all(la.whole for la in self.layers))
        self.embd = None  # the embedding table, where the kernels look tokens up too: a step from ids (decode_tokens)
        if self.whole_model:
            try:
                self.embd = kl.Embedding(model.embd, s.hidden)
            except ValueError:
                pass
        self._stacks: dict[tuple[int, int], object] = {}  # (first, stop) -> LayerStack
        self._cos = self._sin = torch.empty((0, s.rotary_dim // 2))

    @staticmethod
    def build(model: Model) -> FusedAttention | None:
        cpu = getattr(model.ops, "cpu", None)  # KernelOps carries the CPU kernels
        if cpu is None or model.dtype != torch.float32 or not model.spec.fused_decode:
            return None  # attention the C block does not implement (ModelSpec.fused_decode)
        from moerun.kernels import layer as kl

        try:
            return FusedAttention(model, cpu, kl)
        except ValueError:  # a weight type or layout the fused block does not take
            return None

    def usable(self, n_rows: int, device: torch.device) -> bool:
        return n_rows <= self.MAX_ROWS and device.type == "cpu"

    def reads(self, pool) -> bool:
        """Whether the C block reads this pool's keys and values: float32, f16, or Q8_0 with whole blocks per head
        (moerun.engine.kv_types); bf16 and Q4_0 go through torch."""
        s = self.spec
        whole = (s.kv_lora_rank % 32 == 0 and s.qk_rope_dim % 32 == 0) if s.attention == "mla" else s.head_dim % 32 == 0

        def ok(t) -> bool:
            return t.name in ("f32", "f16") or (t.name == "q8_0" and whole)

        return ok(pool.k_type) and (s.attention == "mla" or ok(pool.v_type))  # MLA's latent is its values too

    def _rope(self, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [> top positions, rotary dims / 2], grown by doubling and kept."""
        if self._cos.shape[0] <= top:
            n = max(2 * self._cos.shape[0], top + 1, 256)
            self._cos, self._sin = (t.contiguous() for t in
                                    rope_tables(torch.arange(n), self.spec.rotary_dim, self.spec.rope_theta,
                                                self.spec.yarn))
        return self._cos, self._sin

    def rows(self, kvs: list[SeqKV], pos: torch.Tensor):
        """One step's rows (row r at position pos[r] of the sequence cached in kvs[r])."""
        return self.kl.AttnRows([kv.slot_table for kv in kvs], pos, *self._rope(int(pos.max())),
                                ring_tables=[kv.ring_table for kv in kvs], state_slots=self._states(kvs))

    def _states(self, kvs: list[SeqKV]) -> list[int] | None:
        """Each row's recurrent-state slot, for models with DeltaNet layers."""
        return [kv.state_slot for kv in kvs] if self.spec.hybrid else None

    def whole(self, i: int) -> bool:
        """Whether layer i (an index into the model's layers) can run with its experts in one call."""
        return self.layers[i].whole

    def __call__(self, i: int, x: torch.Tensor, rows, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 moe: bool = False):
        """x [B, H] += layer i's attention (in place) -> (ffn-normed x, ids [B, k], weights [B, k]).
        moe=True (a whole layer): x also gets the experts' output."""
        return self.kl.attn_block(self.layers[i], x, rows, k_cache, v_cache, self.spec.rms_eps, self.spec.clip_qkv,
                                  moe=moe)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """rms_norm(x) @ head^T -> [T, V] float32, as decode_layers(..., logits=True) ends."""
        return self.kl.head_logits(self.head, x.contiguous(), self.spec.rms_eps)

    def decode_layers(self, a: int, b: int, x: torch.Tensor, rows, caches: list[tuple[torch.Tensor, torch.Tensor]],
                      logits: bool = False) -> torch.Tensor:
        """Layers [a, b) (indices into the model's layers, all whole) on x in place, in one call; caches: each
        layer's (k, v) (the stack checks them once: a pool hands out the same views each step, KVPool.caches).
        -> x, or with `logits` (needs self.head) the logits [B, V]."""
        return self.kl.decode_layers(self._stack(a, b), x, rows, caches, self.spec.rms_eps, self.spec.clip_qkv,
                                     self.head if logits else None)

    def decode_tokens(self, tokens: list[int], kvs: list[SeqKV], pos: list[int],
                      caches: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> torch.Tensor:
        """A whole step (whole_model, with embd) from ids to logits [B, V] in one call: token r at position pos[r]
        of the sequence cached in kvs[r], on `threads` of the kernel pool."""
        return self.kl.decode_tokens(self._stack(0, len(self.layers)), self.embd, tokens, pos,
                                     [kv.slot_table for kv in kvs], [kv.ring_table for kv in kvs],
                                     *self._rope(max(pos)), caches, self.spec.rms_eps, self.spec.clip_qkv, self.head,
                                     threads, state_slots=self._states(kvs))

    def _stack(self, a: int, b: int):
        stack = self._stacks.get((a, b))
        if stack is None:
            stack = self._stacks[a, b] = self.kl.LayerStack(self.layers[a:b])
        return stack
