"""The forward pass of every supported family, on one screen. Families differ only through ModelSpec."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moerun import device
from moerun.arch.spec import ModelSpec
from moerun.experts.prefetch import guess_ids
from moerun.experts.store import ExpertReader, ExpertStore
from moerun.formats.names import CName
from moerun.model import deltanet
from moerun.model.fused import FusedAttention
from moerun.model.gpu_decode import GpuDecode
from moerun.model.layers import SMALL_T, rope_tables
from moerun.model.moe import Experts, ResidentExperts, route
from moerun.model.ops import ExpertFn, Weight, make_ops
from moerun.quant.qtypes import FLOAT_QTYPES, QTensor

if TYPE_CHECKING:  # the engine owns the cache; the model only writes and reads through it
    from moerun.engine.kv_cache import SeqKV


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: Weight  # the query projection (MLA with q_lora_rank: from the normed q latent, attn_q_b)
    wo: Weight
    ffn_norm: torch.Tensor
    wk: Weight | None = None  # GQA
    wv: Weight | None = None
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # the output projection's bias
    sinks: torch.Tensor | None = None  # [n_heads] attention sink logits
    wq_a: Weight | None = None  # MLA: x -> the q latent [q_lora_rank], normed by q_a_norm
    q_a_norm: torch.Tensor | None = None
    wkv_a: Weight | None = None  # MLA: x -> the KV latent [kv_lora_rank] (normed: kv_a_norm), the rotary key
    kv_a_norm: torch.Tensor | None = None
    wk_b: torch.Tensor | None = None  # MLA: [heads, kv_lora_rank, nope], the latent -> each head's key
    wv_b: torch.Tensor | None = None  # MLA: [heads, v_head_dim, kv_lora_rank], the latent -> each value
    wk_b_q: QTensor | None = None  # MLA: wk_b and wv_b as the file stores them (the fused decode reads these bytes)
    wv_b_q: QTensor | None = None
    router: Weight | None = None  # MoE layers
    router_b: torch.Tensor | None = None  # the router's bias
    exp_b: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # routed experts' biases by expert id
    score_b: torch.Tensor | None = None  # the scores' correction bias, for choosing only
    shexp: tuple[Weight, Weight, Weight] | None = None  # shared expert gate, up, down
    shexp_gate: Weight | None = None
    ffn: tuple[Weight, Weight, Weight] | None = None  # dense layers
    # linear attention (gated DeltaNet, moerun.model.deltanet)
    wqkv: Weight | None = None  # x -> q, k, v [conv channels], through the conv1d
    wz: Weight | None = None  # x -> the output gate z [value heads * dv]
    wba: Weight | None = None  # x -> beta and alpha logits, [b (r), a (r)] per key head (Qwen3-Next)
    wbeta: Weight | None = None  # x -> beta logits [value heads]
    walpha: Weight | None = None  # x -> alpha [value heads]
    conv: torch.Tensor | None = None  # [channels, kernel] float32
    ssm_a: torch.Tensor | None = None  # [value heads] -exp(A_log)
    ssm_dt: torch.Tensor | None = None  # [value heads] the decay's softplus bias
    ssm_norm: torch.Tensor | None = None  # [dv] the gated norm's weight
    ssm_out: Weight | None = None


class MoEModel:
    """The whole model, or one stage of it: `layers=(a, b)` holds layers [a, b) only (`weights` need not have
    the others), the embeddings when a == 0 and the head when b == n_layers. Layer indices stay the model's
    (expert statistics, routing traces, the KV pool). `slice` cuts a loaded model into stages; `place` moves a
    stage's dense weights onto a device (moerun.device), whose ops then compute them."""

    def __init__(self, spec: ModelSpec, weights: dict[CName, QTensor], dtype: torch.dtype = torch.float32,
                 experts: Experts | None = None, kernels: bool = True, expert_reader: ExpertReader | None = None,
                 layers: tuple[int, int] | None = None):
        self.spec, self.dtype = spec, dtype
        self.first, self.stop = layers or (0, spec.n_layers)
        if not 0 <= self.first <= self.stop <= spec.n_layers:
            raise ValueError(f"layers {layers} are not a range within the model's {spec.n_layers}")
        self.dev = device.CPU  # where the dense weights live and compute (`place`)
        self.ops = make_ops(kernels)  # quantized CPU kernels when built, else the torch reference

        def mat(kind: str, layer: int | None = None) -> Weight | None:
            t = weights.get(CName(kind, layer))
            if t is None or t.qtype not in FLOAT_QTYPES:
                return t  # quantized stays quantized
            return t.dequantize(dtype)  # zero-copy when the stored type is the compute type

        def vec(kind: str, layer: int | None = None) -> torch.Tensor | None:
            t = weights.get(CName(kind, layer))
            return None if t is None else self.ops.floats(t).to(dtype)

        def f32(kind: str, layer: int) -> torch.Tensor | None:  # the recurrent state's inputs: float32 always
            t = weights.get(CName(kind, layer))
            return None if t is None else t.dequantize(torch.float32)

        self.embd = weights[CName("token_embd.weight")] if self.first == 0 else None
        self.out_norm = vec("output_norm.weight")
        self.head = mat("output.weight") if not spec.tie_embeddings else mat("token_embd.weight")
        self.layers = []  # self.layers[i - self.first] is layer i
        for i in range(self.first, self.stop):
            lw = LayerWeights(
                attn_norm=vec("attn_norm.weight", i), ffn_norm=vec("ffn_norm.weight", i),
                wq=mat("attn_q_b.weight" if CName("attn_q_b.weight", i) in weights else "attn_q.weight", i),
                wk=mat("attn_k.weight", i), wv=mat("attn_v.weight", i), wo=mat("attn_output.weight", i),
                bq=vec("attn_q.bias", i), bk=vec("attn_k.bias", i), bv=vec("attn_v.bias", i),
                q_norm=vec("attn_q_norm.weight", i), k_norm=vec("attn_k_norm.weight", i),
                bo=vec("attn_output.bias", i), sinks=vec("attn_sinks.weight", i),
                wq_a=mat("attn_q_a.weight", i), q_a_norm=vec("attn_q_a_norm.weight", i),
                wkv_a=mat("attn_kv_a_mqa.weight", i), kv_a_norm=vec("attn_kv_a_norm.weight", i),
                wk_b=vec("attn_k_b.weight", i), wv_b=vec("attn_v_b.weight", i),  # floats: multiplied per head
                wk_b_q=weights.get(CName("attn_k_b.weight", i)), wv_b_q=weights.get(CName("attn_v_b.weight", i)),
                wqkv=mat("attn_qkv.weight", i), wz=mat("attn_gate.weight", i), wba=mat("ssm_ba.weight", i),
                wbeta=mat("ssm_beta.weight", i), walpha=mat("ssm_alpha.weight", i), ssm_out=mat("ssm_out.weight", i),
                conv=f32("ssm_conv1d.weight", i), ssm_a=f32("ssm_a", i), ssm_dt=f32("ssm_dt.bias", i),
                ssm_norm=f32("ssm_norm.weight", i),
            )
            if spec.moe_layers[i]:
                lw.router = mat("ffn_gate_inp.weight", i)
                lw.router_b = vec("ffn_gate_inp.bias", i)
                if spec.expert_bias:
                    lw.exp_b = tuple(vec(f"ffn_{m}_exps.bias", i) for m in ("gate", "up", "down"))
                score_b = weights.get(CName("exp_probs_b.bias", i))  # float32 always: it only ranks the scores
                lw.score_b = None if score_b is None else score_b.dequantize(torch.float32)
                if spec.shared_ffn:
                    lw.shexp = (mat("ffn_gate_shexp.weight", i), mat("ffn_up_shexp.weight", i),
                                mat("ffn_down_shexp.weight", i))
                    gate = vec("ffn_gate_inp_shexp.weight", i)
                    lw.shexp_gate = None if gate is None else gate.reshape(1, spec.hidden)
            else:
                lw.ffn = (mat("ffn_gate.weight", i), mat("ffn_up.weight", i), mat("ffn_down.weight", i))
            self.layers.append(lw)
        self.store = ExpertStore(*({i: weights[CName(f"ffn_{k}_exps.weight", i)]
                                    for i in range(self.first, self.stop) if spec.moe_layers[i]}
                                   for k in ("gate", "up", "down")), reader=expert_reader)
        self.experts = experts or ResidentExperts(self.store)
        moe = [i for i in range(self.first, self.stop) if spec.moe_layers[i]]
        self._next_moe = dict(pairwise(moe))  # MoE layer -> the next one (prefetch target)
        # called with (layer, phase, positions [T], ids [T, k], weights [T, k]) after each routing decision
        self.on_route: Callable[[int, str, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self.fused = FusedAttention.build(self)  # small steps' attention in one C call per layer, when it applies
        self._gpu: GpuDecode | None = None  # a GPU's decode layers in a few launches each, built at first use

    def slice(self, a: int, b: int) -> MoEModel:
        """A stage of this model: layers [a, b) (within this model's), sharing their weights; the embeddings
        when a == 0, the head when b == n_layers; its own expert source over its layers' experts."""
        if not self.first <= a <= b <= self.stop:
            raise ValueError(f"layers {a}..{b - 1} are not within this model's {self.first}..{self.stop - 1}")
        m = copy.copy(self)
        m.first, m.stop = a, b
        m.layers = self.layers[a - self.first:b - self.first]
        m.embd = self.embd if a == 0 else None
        if b != self.spec.n_layers:
            m.out_norm = m.head = None
        m.store = self.store.subset(a, b)
        m.experts = ResidentExperts(m.store)
        m._next_moe = {i: j for i, j in self._next_moe.items() if a <= i < b and j < b}
        m.on_route = None
        m.fused, m._gpu = FusedAttention.build(m), None
        return m

    def place(self, dev: device.Device, ops) -> None:
        """Move this model's dense weights (its layers', and the embeddings and head it holds) into `dev`'s
        memory, computed there by `ops`; routed experts stay in the store (the home tier). The fused C paths
        are the CPU's and are dropped, so a stand-in device runs the same torch path as a GPU."""
        moved: dict[int, object] = {}  # a weight shared by two fields (tied embeddings) moves once

        def mv(t):
            if t is None or id(t) in moved:
                return t if t is None else moved[id(t)]
            if isinstance(t, tuple):
                return tuple(mv(x) for x in t)
            if isinstance(t, QTensor):
                if t.interleave != 1 and dev.is_cuda:
                    raise ValueError("weights in the CPU kernels' interleaved layout cannot go to a GPU (load them "
                                     "without repack)")
                out = QTensor(device.to_device(t.data, dev), t.qtype, t.shape, t.interleave)
            else:
                out = device.to_device(t, dev)
            moved[id(t)] = out
            return out

        for lw in self.layers:
            for f in fields(lw):
                setattr(lw, f.name, mv(getattr(lw, f.name)))
        self.embd, self.head, self.out_norm = mv(self.embd), mv(self.head), mv(self.out_norm)
        self.dev, self.ops, self.fused, self._gpu = dev, ops, None, None

    @property
    def kv_segments(self) -> list[tuple[int, int, torch.device]]:
        """What the KV pool holds for this model: its layers, on its device."""
        return [(self.first, self.stop, self.dev.torch)]

    @property
    def logits_device(self) -> torch.device:
        return self.dev.torch

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        cpu = getattr(self.ops, "cpu", None)
        if cpu is not None and cpu.supports(self.embd.qtype) and self.embd.data.is_cpu:
            return cpu.dequant_rows(self.embd, tokens).to(self.dtype)  # [T, H], the values gguf.quants gives
        tokens = device.upload(tokens, self.dev)
        rows = QTensor(self.embd.data[tokens], self.embd.qtype, (len(tokens), self.spec.hidden))
        return rows.dequantize(self.dtype)  # [T, H]

    def attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, rope, kv: SeqKV | list[SeqKV] | None
                  ) -> torch.Tensor:
        """Attention of layer i on x [T, H]: one sequence's T positions continuing `kv` (a prompt chunk; None:
        nothing cached), or one position of each of T sequences (kv a list: projected together, each row then
        attending over its own cache). Positions in the cache come from the caches' lengths (host integers,
        never read back from `pos`)."""
        if self.spec.attention == "mla":
            return self.latent_attention(i, x, pos, rope, kv)
        s, lw, T = self.spec, self.layers[i - self.first], x.shape[0]
        mm = self.ops.linear
        q, k, v = self.ops.linears(x, [lw.wq, lw.wk, lw.wv], [lw.bq, lw.bk, lw.bv])  # [T, q_dim|kv_dim]
        gate = None
        if s.attn_gate:  # each head's q is followed by its output gate
            q, gate = (t.reshape(T, -1) for t in q.view(T, s.n_heads, 2 * s.head_dim).chunk(2, dim=-1))
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        if s.qk_norm == "full":
            q, k = self.ops.rms_norm(q, lw.q_norm, s.rms_eps), self.ops.rms_norm(k, lw.k_norm, s.rms_eps)
        q, k, v = q.view(T, s.n_heads, s.head_dim), k.view(T, s.n_kv_heads, s.head_dim), v.view(T, -1, s.head_dim)
        if s.qk_norm == "head":
            q, k = self.ops.rms_norm(q, lw.q_norm, s.rms_eps), self.ops.rms_norm(k, lw.k_norm, s.rms_eps)
        q, k = self.ops.rope(q, *rope, s.rope_style), self.ops.rope(k, *rope, s.rope_style)
        if isinstance(kv, list):
            out = torch.cat([self._attend_cached(i, q[r:r + 1], k[r:r + 1], v[r:r + 1], pos[r:r + 1], kv[r])
                             for r in range(T)])
        else:
            out = self._attend_cached(i, q, k, v, pos, kv)  # [T, nh*D]
        if gate is not None:
            out = self.ops.gate(out, gate)
        return mm(out, lw.wo, lw.bo)  # [T, H]

    def _attend_cached(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                       kv: SeqKV | None) -> torch.Tensor:
        """q [T, nh, D], k / v [T, nkv, D] at positions kv.length.. (pos [T] on the device): written to the cache,
        attended over everything it holds -> [T, nh * Dv]."""
        s, lw, T = self.spec, self.layers[i - self.first], q.shape[0]
        window, k_pos, start = s.sliding_window if s.sliding(i) else 0, pos, None
        if kv is not None:  # queries start..end, keys consecutive up to end: attend reads no position back
            start = kv.length
            end = start + T
        if kv is not None and i in kv.pool.windowed:  # a ring of the last window: read what it held, then write
            lo = max(0, start - window + 1)
            k_old, v_old = kv.read(i, start, lo)  # [start - lo, kv_heads, D]
            kv.write(i, start, k, v)
            k, v = torch.cat((k_old, k.to(k_old.dtype))), torch.cat((v_old, v.to(v_old.dtype)))
            k_pos = torch.arange(lo, end, device=q.device)
        elif kv is not None:  # append to the cache, attend over everything cached so far
            kv.write(i, start, k, v)
            k, v = kv.read(i, end)  # [end, kv_heads, D]
            k_pos = torch.arange(end, device=q.device)
        return self.ops.attend(q, k, v, pos, k_pos, scale=s.softmax_scale, sinks=lw.sinks, window=window, q_start=start)

    def linear_attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, kv: SeqKV | list[SeqKV] | None
                         ) -> torch.Tensor:
        """Gated DeltaNet (moerun.model.deltanet) on x [T, H]: one sequence's T positions continuing `kv`'s
        state (a prompt chunk; None: from zeros, nothing kept), or one position of each of T sequences
        (kv a list). A sequence at position 0 starts from zeros, whatever its state slot held."""
        s, lw, T = self.spec, self.layers[i - self.first], x.shape[0]
        mm = self.ops.linear
        nk, nv, dk, dv = s.ssm_k_heads, s.ssm_v_heads, s.ssm_k_dim, s.ssm_v_dim
        if lw.wba is not None:  # beta and alpha: [b (r), a (r)] per key head
            qkv, z, ba = self.ops.linears(x, [lw.wqkv, lw.wz, lw.wba])  # [T, C], [T, nv * dv], [T, 2 nv]
            b, a = (t.reshape(T, nv) for t in ba.view(T, nk, 2, nv // nk).unbind(2))
        else:
            qkv, z, b, a = self.ops.linears(x, [lw.wqkv, lw.wz, lw.wbeta, lw.walpha])  # b, a [T, nv]
        z = z.view(T, nv, dv)
        rows = kv if isinstance(kv, list) else [kv] * T if kv is not None and T <= SMALL_T else None
        if rows is not None and self._delta_c(qkv, rows[0].pool.state(i)[1]):  # decode-sized steps in C
            conv_all, ssm_all = rows[0].pool.state(i)  # updated in place at the rows' slots
            slots = torch.tensor([r.state_slot for r in rows], dtype=torch.int64)
            z, waves = z.reshape(T, -1), [slice(0, T)] if isinstance(kv, list) else [slice(r, r + 1) for r in range(T)]
            out = torch.cat([self._delta_kernels.delta_step(  # one sequence's rows one after the other, as fused
                qkv[w].contiguous(), z[w].contiguous(), b[w].contiguous(), a[w].contiguous(), conv_all, ssm_all,
                slots[w], pos[w] == 0, lw.conv, lw.ssm_a, lw.ssm_dt, lw.ssm_norm, s.rms_eps, nk,
                s.ssm_v_order == "tiled") for w in waves])  # [T, nv * dv]
            return mm(out.to(x.dtype), lw.ssm_out)  # [T, H]
        beta, g = torch.sigmoid(b.float()), lw.ssm_a * F.softplus(a.float() + lw.ssm_dt)  # [T, nv]
        split = (nk * dk, nk * dk, nv * dv)
        if isinstance(kv, list):  # decode: row r is the next position of kvs[r]
            conv_all, ssm_all = kv[0].pool.state(i)
            slots = torch.tensor([kv_r.state_slot for kv_r in kv], device=conv_all.device)
            fresh = (pos == 0).to(conv_all.device)[:, None, None]
            conv0 = conv_all.index_select(0, slots).masked_fill(fresh, 0.0)
            ssm0 = ssm_all.index_select(0, slots).masked_fill(fresh[..., None], 0.0)
            y, conv1 = deltanet.conv_step(qkv, lw.conv, conv0)  # [T, C]
            q, k, v = y.split(split, dim=-1)
            o, ssm1 = deltanet.delta_step(q.view(T, nk, dk), k.view(T, nk, dk), v.view(T, nv, dv), g, beta, ssm0,
                                          s.ssm_v_order)
            conv_all.index_copy_(0, slots, conv1.to(conv_all.dtype))
            ssm_all.index_copy_(0, slots, ssm1)
        else:
            conv0 = ssm0 = None
            if kv is not None and kv.length > 0:
                conv_all, ssm_all = kv.pool.state(i)
                conv0, ssm0 = conv_all[kv.state_slot], ssm_all[kv.state_slot]
            if self._delta_c(qkv, g if ssm0 is None else ssm0):  # conv1d, delta rule, gated norm in C, states in place
                conv1 = torch.zeros((qkv.shape[1], lw.conv.shape[1] - 1)) if conv0 is None else conv0  # [C, K-1]
                ssm1 = torch.zeros((nv, dk, dv)) if ssm0 is None else ssm0  # [nv, dk, dv]
                y = self._delta_kernels.conv_prompt(qkv, lw.conv.float(), conv1)  # [T, C]
                q, k, v = (t.reshape(T, -1, d) for t, d in zip(y.split(split, dim=-1), (dk, dk, dv)))
                out = self._delta_kernels.delta_prompt(q, k, v, g, beta, ssm1, s.ssm_v_order,
                                                       (z, lw.ssm_norm.float(), s.rms_eps))  # [T, nv, dv]
            else:
                y, conv1 = deltanet.conv_prompt(qkv, lw.conv, conv0)
                q, k, v = (t.reshape(T, -1, d) for t, d in zip(y.split(split, dim=-1), (dk, dk, dv)))
                if T <= deltanet.STEP_T:  # a few positions: the recurrence itself (the chunked form pads to 64)
                    o, ssm1 = deltanet.delta_steps(q, k, v, g, beta, ssm0, s.ssm_v_order)
                else:
                    o, ssm1 = deltanet.delta_chunked(q, k, v, g, beta, ssm0, s.ssm_v_order)
                out = None
            if kv is not None:
                conv_all, ssm_all = kv.pool.state(i)
                conv_all[kv.state_slot] = conv1
                ssm_all[kv.state_slot] = ssm1
            if out is not None:
                return mm(out.to(x.dtype).reshape(T, nv * dv), lw.ssm_out)  # [T, H]
        out = deltanet.gated_norm(o, lw.ssm_norm, z, s.rms_eps).to(x.dtype)  # [T, nv, dv]
        return mm(out.reshape(T, nv * dv), lw.ssm_out)  # [T, H]

    def latent_attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, rope,
                         kv: SeqKV | None) -> torch.Tensor:
        """DeepSeek's multi-head latent attention: the cache keeps one latent per position (the normed
        compression and the rotated key all heads share), absorbed into the queries for small steps, expanded
        into keys and values for prompt chunks (layers.mla_form)."""
        s, lw, T = self.spec, self.layers[i - self.first], x.shape[0]
        mm = self.ops.linear
        q, ckv = self.ops.linears(x, [lw.wq if lw.wq_a is None else lw.wq_a, lw.wkv_a])  # x's products in one call
        if lw.wq_a is not None:
            q = mm(self.ops.rms_norm(q, lw.q_a_norm, s.rms_eps), lw.wq)
        q_nope, q_pe = q.view(T, s.n_heads, s.head_dim).split((s.qk_nope_dim, s.qk_rope_dim), dim=-1)
        c, k_pe = ckv.split((s.kv_lora_rank, s.qk_rope_dim), dim=-1)  # [T, rank], [T, rope]
        q_pe = self.ops.rope(q_pe, *rope, s.rope_style)  # [T, nh, rope]
        latent = torch.cat((self.ops.rms_norm(c, lw.kv_a_norm, s.rms_eps),
                            self.ops.rope(k_pe[:, None], *rope, s.rope_style)[:, 0]), dim=-1)  # [T, rank + rope]
        if isinstance(kv, list):  # one row per sequence, projected together above
            out = torch.cat([self._latent_cached(i, q_nope[r:r + 1], q_pe[r:r + 1], latent[r:r + 1], pos[r:r + 1],
                                                 kv[r]) for r in range(T)])
        else:
            out = self._latent_cached(i, q_nope, q_pe, latent, pos, kv)  # [T, nh * v]
        return mm(out, lw.wo)  # [T, H]

    def _latent_cached(self, i: int, q_nope, q_pe, latent, pos, kv: SeqKV | None) -> torch.Tensor:
        lw, k_pos, start = self.layers[i - self.first], pos, None
        if kv is not None:
            start = kv.length
            kv.write(i, start, latent)
            latent = kv.read(i, start + latent.shape[0])[0]  # [S, rank + rope]
            k_pos = torch.arange(latent.shape[0], device=latent.device)
        return self.ops.mla(q_nope, q_pe, latent, lw.wk_b, lw.wv_b, pos, k_pos, self.spec.softmax_scale, q_start=start)

    def _delta_c(self, qkv: torch.Tensor, state: torch.Tensor) -> bool:
        """Whether the recurrence runs in C (moerun.kernels.delta: decode steps, prompt chunks): the kernels built,
        float32 on the CPU."""
        if not hasattr(self, "_delta_kernels"):
            try:
                from moerun.kernels import delta
            except ImportError:
                delta = None
            self._delta_kernels = delta if getattr(self.ops, "cpu", None) is not None else None
        return self._delta_kernels is not None and self._delta_kernels.usable(qkv, state)

    def _prefetch_next(self, i: int, resid: torch.Tensor) -> None:
        """DESIGN decision 6: guess the next MoE layer's experts with its router on the hidden state after layer
        i's attention (rms-normed with that layer's ffn_norm; layer i's expert output is not known yet) and
        hand the top-k to the expert source to page in while layer i's experts compute."""
        j = self._next_moe.get(i)
        if j is None:
            return
        s, lw = self.spec, self.layers[j - self.first]
        p, ids = route(self.ops, self.ops.rms_norm(resid, lw.ffn_norm, s.rms_eps), lw, s, raw=True)
        self.experts.prefetch(j, guess_ids(p, ids))

    def ffn(self, i: int, x: torch.Tensor, phase: str, pos: torch.Tensor,
            resid: torch.Tensor | None = None) -> torch.Tensor:
        """x: the normed input; resid (optional): the un-normed hidden state, for a decode step's prefetch."""
        s, lw, ops = self.spec, self.layers[i - self.first], self.ops
        if lw.ffn is not None:
            return ops.swiglu(x, *lw.ffn)
        if lw.shexp is None:
            w, ids = route(ops, x, lw, s)  # [T, k]
            return self.moe(i, x, w, ids, phase, pos, resid)
        gate = [lw.shexp_gate] if lw.shexp_gate is not None else []
        logits, *shared = ops.linears(x, [lw.router, lw.shexp[0], lw.shexp[1], *gate])  # one call: same input
        w, ids = route(ops, x, lw, s, logits=logits)
        return self.moe(i, x, w, ids, phase, pos, resid, shared)

    def expert_fn(self, i: int) -> ExpertFn:
        """Layer i's routed experts' activation and biases."""
        s = self.spec
        return ExpertFn(s.expert_act, s.swiglu_alpha, s.swiglu_limit, self.layers[i - self.first].exp_b)

    def moe(self, i: int, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, phase: str, pos: torch.Tensor,
            resid: torch.Tensor | None = None, shared: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The routed experts (ids, w [T, k]) and the shared expert of MoE layer i on the normed x [T, H]; shared:
        the shared expert's gate and up products (and its gate's logit) when the caller has them."""
        lw, ops = self.layers[i - self.first], self.ops
        fn = self.expert_fn(i)
        if self.on_route is not None:
            self.on_route(i, phase, pos, ids, w)
        stacks = self.store.stacks(i) if self._direct() else None  # experts read where they are stored
        if hasattr(self.experts, "run"):  # a device stage's (offload.py), or the ranks' under expert parallelism (shards.py)
            if resid is not None and phase == "decode" and getattr(self.experts, "prefetching", False):
                out = self.experts.run(i, x, ids, w, phase, fn, ahead=lambda: self._prefetch_next(i, resid))
            else:
                out = self.experts.run(i, x, ids, w, phase, fn)
        elif stacks is None or (out := ops.moe_stacked(x, ids, w, stacks, fn=fn)) is None:
            experts = self.experts.fetch(i, sorted(set(ids.view(-1).tolist())), phase)
            if resid is not None and phase == "decode" and getattr(self.experts, "prefetching", False):
                self._prefetch_next(i, resid)  # after this layer's fetch, so it never competes with its loads
            out = ops.moe(x, ids, w, experts, fn=fn)
        if lw.shexp is not None:
            g, u, *gate = shared or ops.linears(x, [lw.shexp[0], lw.shexp[1]] + ([lw.shexp_gate] if lw.shexp_gate
                                                                                   is not None else []))
            out = out + ops.glu_down(g, u, lw.shexp[2], gate[0] if gate else None)
        return out

    def _layers_fused(self, x: torch.Tensor, kvs: list[SeqKV], pos: torch.Tensor, phase: str,
                      layers: range) -> torch.Tensor:
        """`layers` on rows x [B, H], row r at position pos[r] of kvs[r] (room reserved)."""
        rows, pool = self.fused.rows(kvs, pos), kvs[0].pool
        direct = self._direct()
        a, b = layers.start - self.first, layers.stop - self.first
        caches = pool.caches(layers.start, layers.stop)
        if direct and all(self.fused.whole(j) for j in range(a, b)):
            return self.fused.decode_layers(a, b, x, rows, caches)  # x in place
        for i, cache in zip(layers, caches):
            j = i - self.first
            lw = self.layers[j]
            whole = direct and self.fused.whole(j)
            xn, ids, w = self.fused(j, x, rows, *cache, moe=whole)  # x += the mixer (+ the FFN)
            if not whole:
                x += self.ops.swiglu(xn, *lw.ffn) if lw.ffn is not None else self.moe(i, xn, w, ids, phase, pos, x)
        return x

    def _direct(self) -> bool:
        """Experts read where they are stored and nobody watching the routing: whole layers may run in C."""
        return (self.on_route is None and isinstance(self.experts, ResidentExperts)
                and self.experts.store is self.store)

    def _whole(self, kvs: list[SeqKV] | None) -> bool:
        """Whether a small step over kvs (a row each) can go from its embeddings to its logits in one C call (every
        layer whole, this model holding them all and the head): `_whole_logits`."""
        f = self.fused
        return kvs is not None and f is not None and f.whole_model and self._fused_ok(len(kvs), kvs) and self._direct()

    def _from_ids(self, kvs: list[SeqKV]) -> bool:
        """Whether a small step over kvs goes from token ids to logits in one C call (`_whole` and the embedding
        looked up there too): `_ids_logits`."""
        return self._whole(kvs) and self.fused.embd is not None

    def _ids_logits(self, tokens: torch.Tensor, kvs: list[SeqKV], pos: list[int]) -> torch.Tensor:
        """Logits [B, V] for token r at position pos[r] of kvs[r] (room reserved). No torch operation but the
        logits' allocation: after a step has streamed the weights, each costs ~5x its warm time (~0.3 ms of
        Python and torch around an a3b-L12 token, bench/RESULTS.md)."""
        return self.fused.decode_tokens(tokens.tolist(), kvs, pos, kvs[0].pool.caches(self.first, self.stop),
                                        self.ops.c_threads())

    def _whole_logits(self, x: torch.Tensor, kvs: list[SeqKV], pos: torch.Tensor) -> torch.Tensor:
        return self.fused.decode_layers(0, self.stop - self.first, x, self.fused.rows(kvs, pos),
                                        kvs[0].pool.caches(self.first, self.stop), logits=True)

    def _fused_ok(self, n_rows: int, kvs: list[SeqKV]) -> bool:
        pool = kvs[0].pool
        return (self.fused is not None and self.first < self.stop and self.fused.usable(n_rows, pool.device(self.first))
                and pool.dtype == torch.float32 and self.fused.reads(pool) and all(kv.pool is pool for kv in kvs))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.head is not None and x.dtype == torch.float32 and x.is_cpu:
            return self.fused.head_logits(x)  # what a whole decode step ends with, so both paths agree exactly
        return self.ops.linear(self.ops.rms_norm(x, self.out_norm, self.spec.rms_eps), self.head).float()

    def run_layers(self, x: torch.Tensor, pos: torch.Tensor, kv: SeqKV | list[SeqKV] | None, phase: str,
                   layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Layers [a, b) (default: all this model holds) on hidden states x [T, H] at positions pos [T] -> x.

        kv: one cache that all T rows continue (a prompt chunk), one cache per row (a decode batch), or None.
        Room must be reserved; lengths are left to the caller."""
        span = range(*(layers or (self.first, self.stop)))
        kvs = kv if isinstance(kv, list) else None if kv is None else [kv] * len(pos)
        if kvs is not None and self._fused_ok(len(pos), kvs):
            return self._layers_fused(x, kvs, pos, phase, span)
        if isinstance(kv, list) and self.on_route is None and GpuDecode.usable(self, kv):  # a GPU's decode step
            if self._gpu is None:
                self._gpu = GpuDecode(self)
            return self._gpu.decode_layers(x.float().contiguous(), kv, span).to(x.dtype)
        pos = device.upload(pos, self.dev) if pos.device != x.device or self.dev.kind == "standin" else pos
        cos, sin = rope_tables(pos, self.spec.rotary_dim, self.spec.rope_theta, self.spec.yarn)
        for i in span:
            lw = self.layers[i - self.first]
            xn = self.ops.rms_norm(x, lw.attn_norm, self.spec.rms_eps)
            if self.spec.linear(i):
                x = x + self.linear_attention(i, xn, pos, kv)
            else:
                x = x + self.attention(i, xn, pos, (cos, sin), kv)
            x = x + self.ffn(i, self.ops.rms_norm(x, lw.ffn_norm, self.spec.rms_eps), phase, pos, resid=x)
        return x

    def forward(self, tokens: torch.Tensor, kv: SeqKV | None = None, last_only: bool = False,
                phase: str | None = None) -> torch.Tensor:
        """tokens [T] at positions kv.length.. (0.. without a cache) -> logits [T, V] float32 ([1, V] if last_only).

        With `kv`, the tokens' keys and values are appended to the cache (room reserved here) and attention
        covers every cached position. phase (for expert-cache statistics): "prefill" when T > 1 by default.
        """
        T = len(tokens)
        if kv is not None and T and self._from_ids([kv] * T):
            start = kv.length
            kv.reserve(T)
            logits = self._ids_logits(tokens, [kv] * T, list(range(start, start + T)))
            kv.length = start + T
            return logits[-1:] if last_only and T > 1 else logits
        return self._forward(tokens, kv, last_only, phase)

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, kv: SeqKV | None, last_only: bool, phase: str | None) -> torch.Tensor:
        phase = phase or ("prefill" if len(tokens) > 1 else "decode")
        start = 0 if kv is None else kv.length
        if kv is not None:
            kv.reserve(len(tokens))
        pos = torch.arange(start, start + len(tokens))
        kvs = None if kv is None else [kv] * len(tokens)
        whole = self._whole(kvs)
        with self.ops.step(len(tokens), c_only=whole), device.use(self.dev):
            x = self.embed(tokens)
            if whole:
                logits = self._whole_logits(x, kvs, pos)
                kv.length = start + len(tokens)
                return logits[-1:] if last_only and len(tokens) > 1 else logits
            x = self.run_layers(x, pos, kv, phase)
            if kv is not None:
                kv.length = start + len(tokens)
            return self._head(x[-1:] if last_only else x)

    def decode(self, tokens: torch.Tensor, kvs: list[SeqKV], phase: str = "decode") -> torch.Tensor:
        """One new token for each of B sequences, together: tokens [B] (token b continues kvs[b], at position
        kvs[b].length) -> logits [B, V] float32. Each cache gets room for its token and advances by one; the
        MoE layers see all B tokens at once (the union of their experts)."""
        B = len(tokens)
        if B != len(kvs) or B == 0 or len({id(kv) for kv in kvs}) != B:
            raise ValueError(f"decode takes one token for each of distinct sequences: {B} tokens, "
                             f"{len(kvs)} caches")
        kvs = list(kvs)
        for kv in kvs:
            kv.reserve(1)
        if self._from_ids(kvs):
            logits = self._ids_logits(tokens, kvs, [kv.length for kv in kvs])
            for kv in kvs:
                kv.length += 1
            return logits
        return self._decode(tokens, kvs, phase)

    def prepare_decode(self, pool) -> int:
        """Before the first request: a GPU's decode steps over `pool` captured for every batch bucket (their kernels
        compiled). Where this model's decode steps are not the GPU path's, or off CUDA (the stand-in compiles
        nothing, and captures at a bucket's first step): 0."""
        if not (self.dev.is_cuda and self.on_route is None and GpuDecode.serves(self, pool)):
            return 0
        if self._gpu is None:
            self._gpu = GpuDecode(self)
        return self._gpu.prepare(pool) if self._gpu.whole() else 0

    @torch.inference_mode()
    def _decode(self, tokens: torch.Tensor, kvs: list[SeqKV], phase: str) -> torch.Tensor:
        if self.on_route is None and GpuDecode.usable(self, kvs):  # a GPU's whole step, captured and replayed
            if self._gpu is None:
                self._gpu = GpuDecode(self)
            if self._gpu.capturable(kvs):
                with device.use(self.dev):
                    logits = self._gpu.step(tokens, kvs)
                for kv in kvs:
                    kv.length += 1
                return logits
        pos = torch.tensor([kv.length for kv in kvs], dtype=torch.int64)
        whole = self._whole(kvs)
        with self.ops.step(len(kvs), c_only=whole), device.use(self.dev):
            x = self.embed(tokens)
            if whole:
                logits = self._whole_logits(x, kvs, pos)
            else:
                logits = self._head(self.run_layers(x, pos, kvs, phase))
            for kv in kvs:
                kv.length += 1
            return logits
