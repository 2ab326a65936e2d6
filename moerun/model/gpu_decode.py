"""A decode step's layers on a GPU (or its stand-in) in a few Triton launches each, no host read.

Per layer, B rows (one new token of each of B sequences), x the float32 residual stream [B, H]:

    qkv  = (rms_norm(x) * attn_norm) @ [wq; wk; wv]^T (+ biases)     triton_q.matmul_multi, the norm in its prologue
    q    = rope(norm_heads(q)); k, v -> the paged cache at the rows' slots              triton_attn.qk_rope_kv_write
    att  = softmax(q k^T) v over each row's cache (lengths, block table on the device)  triton_attn.decode_attention
    x   += att @ wo^T (+ bias)                                                          triton_q.matmul, accumulate
    xn   = rms_norm(x) * ffn_norm;  logits = xn @ router^T                              triton_decode.rms_norm, torch
    ids, w = route(logits)                                                              triton_decode.route
    x   += sum_j w_j expert_j(xn)                                                       triton_q.moe_ffn, accumulate

Where it applies (`usable`): GQA attention without windows or output gates, a plain pool without rings, every
MoE layer's experts resident on the device, the Triton kernels in use. Elsewhere the torch layer loop runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerun import device
from moerun.model.layers import rope_frequencies


class GpuDecode:
    def __init__(self, model):
        import importlib

        from moerun.kernels import triton_attn, triton_decode, triton_q

        triton_q._kernels()  # its modules built for the TRITON_INTERPRET now in force
        if triton_attn.INTERPRETED != triton_q.interpreting():  # as were these, at their import
            triton_attn = importlib.reload(triton_attn)
            triton_decode = importlib.reload(triton_decode)
        self.m, self.tq, self.ta, self.td = model, triton_q, triton_attn, triton_decode
        s = model.spec
        self.inv_freq = device.upload(rope_frequencies(s.rotary_dim, s.rope_theta, s.yarn), model.dev)
        self.attn_factor = s.yarn.attention_factor if s.yarn is not None else 1.0

    @staticmethod
    def usable(model, kvs) -> bool:
        s, experts = model.spec, model.experts
        if not (model.dev.accelerator and type(model.ops).__name__ == "TritonOps" and model.dtype == torch.float32):
            return False
        pool = kvs[0].pool
        return (s.attention == "gqa" and not s.hybrid and not s.attn_gate and s.clip_qkv is None
                and s.qk_norm in ("none", "head") and not s.sliding_window and not s.shared_ffn
                and pool.plain and not pool.ring and all(kv.pool is pool for kv in kvs)
                and all(not s.moe_layers[i] or i in getattr(experts, "resident", {})
                        for i in range(model.first, model.stop)))

    def meta(self, kvs) -> tuple[torch.Tensor, ...]:
        """positions, slots, lengths [B] and the block table [B, W] (int32), uploaded together."""
        bs, B = kvs[0].pool.block_size, len(kvs)
        w = max(len(kv.blocks) for kv in kvs)
        pos = [kv.length for kv in kvs]
        slots = [kv.blocks[p // bs] * bs + p % bs for kv, p in zip(kvs, pos)]
        table = [b for kv in kvs for b in kv.blocks + [0] * (w - len(kv.blocks))]
        # positions [B] | slots [B] | lengths [B] | table [B, W], one host tensor made from Python ints
        host = torch.tensor(pos + slots + [p + 1 for p in pos] + table, dtype=torch.int32)
        dev = device.upload(host, self.m.dev)
        return dev[:B], dev[B:2 * B], dev[2 * B:3 * B], dev[3 * B:].view(B, w)

    def layers(self, x: torch.Tensor, kvs, span: range) -> torch.Tensor:
        """x [B, H] float32 through layers `span` (their KV written, lengths left to the caller)."""
        pos, slots, lengths, table = self.meta(kvs)
        pool = kvs[0].pool
        for i in span:
            self.layer(i, x, pos, slots, lengths, table, *pool.layer(i), pool.block_size)
        return x

    def layer(self, i, x, pos, slots, lengths, table, kc, vc, bs) -> None:
        m, s, tq = self.m, self.m.spec, self.tq
        lw = m.layers[i - m.first]
        B = x.shape[0]
        biases = [lw.bq, lw.bk, lw.bv] if lw.bq is not None or lw.bk is not None or lw.bv is not None else None
        qkv = tq.matmul_multi(x, [lw.wq, lw.wk, lw.wv], norm=(lw.attn_norm, s.rms_eps), biases=biases)
        q = torch.empty(B, s.n_heads, s.head_dim, dtype=torch.float32, device=x.device)
        self.ta.qk_rope_kv_write(qkv, pos, slots, kc, vc, q, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                                 head_dim=s.head_dim, inv_freq=self.inv_freq, rotary_dim=s.rotary_dim,
                                 rope_style="neox" if s.rope_style == "neox" else "interleaved",
                                 attn_factor=self.attn_factor, q_norm=lw.q_norm if s.qk_norm == "head" else None,
                                 k_norm=lw.k_norm if s.qk_norm == "head" else None, eps=s.rms_eps)
        att = torch.empty(B, s.n_heads * s.head_dim, dtype=torch.float32, device=x.device)
        self.ta.decode_attention(q, kc, vc, table, lengths, att, scale=s.softmax_scale, block_size=bs,
                                 sinks=lw.sinks, max_positions=table.shape[1] * bs)
        tq.matmul(att, lw.wo, bias=lw.bo, out=x, accumulate=True)
        xn = torch.empty_like(x)
        self.td.rms_norm(x, lw.ffn_norm, s.rms_eps, xn)
        if lw.ffn is not None:
            x += m.ops.swiglu(xn, *lw.ffn)
            return
        router = lw.router if isinstance(lw.router, torch.Tensor) else None
        logits = F.linear(xn, router, lw.router_b).float() if router is not None else \
            m.ops.linear(xn, lw.router, lw.router_b).float()
        k = s.n_experts_used
        ids = torch.empty(B, k, dtype=torch.int32, device=x.device)
        w = torch.empty(B, k, dtype=torch.float32, device=x.device)
        self.td.route(logits, k, ids, w, mode=s.router, norm_topk=s.norm_topk, routed_scale=s.routed_scale,
                      score_bias=lw.score_b, n_groups=s.n_groups, topk_groups=s.topk_groups,
                      group_score=s.group_score)
        ex = m.experts
        if i not in ex._tables:
            ex._tables[i] = m.ops.moe_table(ex.resident[i])
        fn = m.expert_fn(i)
        tq.moe_ffn(xn, ids, w, ex.resident[i], table=ex._tables[i], fn=None if fn.plain else fn, out=x,
                   accumulate=True)
