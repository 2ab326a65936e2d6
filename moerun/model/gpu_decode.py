"""A decode step's layers on a GPU (or its stand-in) in a few Triton launches each, no host read.

Per layer, B rows (one new token of each of B sequences), x the float32 residual stream [B, H]:

    qkv  = (rms_norm(x) * attn_norm) @ [wq; wk; wv]^T (+ biases)     triton_q.matmul_multi, the norm in its prologue
    q    = rope(norm_heads(q)); k, v -> the paged cache at the rows' slots              triton_attn.qk_rope_kv_write
    att  = softmax(q k^T) v over each row's cache (lengths, block table on the device)  triton_attn.decode_attention
    x   += att @ wo^T (+ bias)                                                          triton_q.matmul, accumulate
    xn   = rms_norm(x) * ffn_norm;  logits = xn @ router^T                              triton_decode.rms_norm, torch
    ids, w = route(logits)                                                              triton_decode.route
    x   += sum_j w_j expert_j(xn)                                                       triton_q.moe_ffn, accumulate

Where it applies (`usable`): GQA attention without output gates (sliding windows, rings and sinks included), a
pool of the compute dtype, every MoE layer's experts resident on the device, the Triton kernels in use. Elsewhere
the torch layer loop runs. A sliding-window layer whose pool keeps a ring per sequence reads it through the ring's
blocks (decode_attention's `ring`); the rows' slots there are their ring slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerun import device
from moerun.model.layers import rms_norm, rope_frequencies

BUCKETS = (1, 2, 4, 8, 16)  # batch sizes a decode step is captured for (a batch is padded up to the next)


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
        self._bias: dict[int, torch.Tensor | None] = {}
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph, its inputs [bucket tokens | meta], logits, pool)
        self._hosts: dict[int, tuple] = {}  # bucket -> the page-locked host buffer its inputs come from, as numpy
        self._copied: dict[int, device.Event] = {}  # bucket -> after the last copy out of that buffer

    @staticmethod
    def usable(model, kvs) -> bool:
        return all(kv.pool is kvs[0].pool for kv in kvs) and GpuDecode.serves(model, kvs[0].pool)

    @staticmethod
    def serves(model, pool) -> bool:
        """Whether this path computes `model`'s decode steps over `pool` (module docstring)."""
        s, experts = model.spec, model.experts
        if not (model.dev.accelerator and type(model.ops).__name__ == "TritonOps" and model.dtype == torch.float32):
            return False
        return (s.attention == "gqa" and not s.hybrid and not s.attn_gate and s.clip_qkv is None
                and s.qk_norm in ("none", "head") and not s.shared_ffn
                and pool.plain
                and all(not s.moe_layers[i] or i in getattr(experts, "resident", {})
                        for i in range(model.first, model.stop)))

    # -------------------------------------------------------------------------------------- a captured step

    def capturable(self, kvs) -> bool:
        """Whether a whole decode step (embedding to logits) of len(kvs) rows can be a graph: this model holds
        every layer, the embeddings and the head, and the batch fits a bucket."""
        return len(kvs) <= BUCKETS[-1] and self.whole()

    def whole(self) -> bool:
        m = self.m
        return (m.first == 0 and m.stop == m.spec.n_layers and m.embd is not None and m.head is not None
                and m.embd.qtype in self.td.EMBED_QTYPES)

    def step(self, tokens: torch.Tensor, kvs) -> torch.Tensor:
        """Logits [B, V] of one new token for each of the B sequences (token r at kvs[r].length, room reserved),
        through the graph of B's bucket: its inputs written, the graph replayed. The first step of a bucket runs
        once eagerly (kernels compiled, tables built), is captured, then replayed. Rows past B are padding: no
        KV written (slot -1), nothing attended (length 0)."""
        B, pool = len(kvs), kvs[0].pool
        bucket = next(b for b in BUCKETS if b >= B)
        with device.on_host(self.m.dev):  # the step's token ids: host memory by decode's contract
            ids = (device.to_host([tokens])[0] if tokens.is_cuda else tokens).tolist()
        host = self._fill(bucket, pool, ids, kvs)
        cap = self._graphs.get(bucket)
        if cap is None or cap[3] is not pool:  # a graph reads and writes its pool's caches: one per pool
            cap = self._capture(host, bucket, pool)
        else:
            device.copy_(cap[1], host)
        self._copied[bucket] = device.Event(self.m.dev).record()  # the host buffer is free again after this
        cap[0].replay()
        return cap[2][:B].clone()  # the graph's buffer is the next step's too

    def _fill(self, bucket: int, pool, ids: list[int], kvs) -> torch.Tensor:
        """The bucket's inputs [tokens | host_meta's layout, W = the pool's blocks] written in place into its own
        page-locked host buffer (through numpy: no allocation, no torch op a step); rows past len(kvs) padding."""
        w, n, bs = pool.allocator.n_blocks, pool.ring, pool.block_size
        copied = self._copied.pop(bucket, None)
        if copied is not None and not copied.query():  # the last step's copy out of the buffer is still queued
            copied.synchronize()
        host, v = self._hosts.get(bucket, (None, None))
        if host is None or host.numel() != bucket * (5 + w + n):
            host = device.pinned_empty(bucket * (5 + w + n) * 4, self.m.dev).view(torch.int32)
            with device.on_host(self.m.dev):  # page-locked host memory: a view of it reads nothing back
                v = host.numpy()
            self._hosts[bucket] = (host, v)
        head = v[:5 * bucket].reshape(5, bucket)  # tokens, positions, slots, lengths, ring slots
        head[:] = ((0,), (0,), (-1,), (0,), (-1,))
        table, rings = v[5 * bucket:5 * bucket + bucket * w].reshape(bucket, w), v[5 * bucket + bucket * w:]
        for r, kv in enumerate(kvs):
            p, blocks = kv.length, kv.blocks
            ring = (kv._ring or 0) * n
            head[:, r] = (ids[r], p, blocks[p // bs] * bs + p % bs, p + 1,
                          ((ring + (p // bs) % n) * bs + p % bs) if n else -1)
            table[r, :len(blocks)] = blocks
            table[r, len(blocks):] = 0
            if n:
                rings[r * n:(r + 1) * n] = range(ring, ring + n)
        return host

    def _capture(self, host: torch.Tensor, bucket: int, pool) -> tuple:
        inputs = device.upload(host, self.m.dev)  # [bucket tokens | meta], static from here on
        self._body(inputs, bucket, pool)  # eager: compiles, builds the experts' tables
        graph = device.Graph(self.m.dev)
        with graph.capture():
            logits = self._body(inputs, bucket, pool)
        self._graphs[bucket] = (graph, inputs, logits, pool)
        return self._graphs[bucket]

    def prepare(self, pool, buckets: tuple[int, ...] = BUCKETS) -> int:
        """Capture each bucket's step for `pool` now (at load: kernels compiled, graphs made before the first
        request), on rows that are all padding (no KV written). Returns the graphs made."""
        made = 0
        for bucket in buckets:
            if bucket in self._graphs and self._graphs[bucket][3] is pool:
                continue
            with device.use(self.m.dev), torch.inference_mode():
                self._capture(self._fill(bucket, pool, [], []), bucket, pool)
            made += 1
        return made

    def _body(self, inputs: torch.Tensor, bucket: int, pool) -> torch.Tensor:
        m, s = self.m, self.m.spec
        x = torch.empty(bucket, s.hidden, dtype=torch.float32, device=inputs.device)  # [Bb, H]
        self.td.embed_rows(inputs[:bucket], m.embd, x)
        self.layers(x, pool, bucket, range(m.first, m.stop), meta=inputs[bucket:])
        if isinstance(m.head, torch.Tensor) or not self.tq.supports(m.head.qtype):
            return m.ops.linear(rms_norm(x, m.out_norm, s.rms_eps), m.head).float()
        return self.tq.matmul(x, m.head, norm=(m.out_norm, s.rms_eps))  # [Bb, V]

    # ------------------------------------------------------------------------------------------ the layers

    @staticmethod
    def host_meta(kvs, width: int | None = None, rows: int | None = None) -> list[int]:
        """The step's positions, slots, lengths, ring slots [B] and block tables [B, W], ring tables [B, R] as one
        list of Python ints (no device read), uploaded as one int32 tensor that `views` cuts. width: W (default:
        the longest sequence's blocks; a captured step fixes it). rows: padded to this many rows (slot -1,
        length 0)."""
        pool, B = kvs[0].pool, len(kvs)
        bs, n, pad = pool.block_size, pool.ring, (rows or B) - B
        w = width or max(len(kv.blocks) for kv in kvs)
        pos = [kv.length for kv in kvs]
        slots = [kv.blocks[p // bs] * bs + p % bs for kv, p in zip(kvs, pos)]
        rings = [kv._ring or 0 for kv in kvs] if n else [0] * B
        ring_slots = [(r * n + (p // bs) % n) * bs + p % bs if n else 0 for r, p in zip(rings, pos)]
        table = [b for kv in kvs for b in kv.blocks + [0] * (w - len(kv.blocks))] + [0] * (pad * w)
        ring_table = [r * n + j for r in rings for j in range(n)] + [0] * (pad * n)
        none = [-1] * pad
        return (pos + [0] * pad + slots + none + [p + 1 for p in pos] + [0] * pad + ring_slots + none + table
                + ring_table)

    @staticmethod
    def views(meta: torch.Tensor, B: int, n: int) -> tuple[torch.Tensor, ...]:
        """host_meta's parts: positions, slots, lengths, ring slots [B], block table [B, W], ring table [B, n]."""
        w = (meta.numel() - 4 * B - B * n) // B
        parts = meta[:4 * B].view(4, B)
        return (*parts.unbind(0), meta[4 * B:4 * B + B * w].view(B, w), meta[4 * B + B * w:].view(B, n))

    def decode_layers(self, x: torch.Tensor, kvs, span: range) -> torch.Tensor:
        """x [B, H] float32 through layers `span` for one new token of each of kvs (room reserved; their KV
        written, lengths left to the caller)."""
        meta = device.upload(torch.tensor(self.host_meta(kvs), dtype=torch.int32), self.m.dev)
        return self.layers(x, kvs[0].pool, len(kvs), span, meta)

    def layers(self, x: torch.Tensor, pool, B: int, span: range, meta: torch.Tensor) -> torch.Tensor:
        """x [B, H] through layers `span`, meta: host_meta's tensor on the device."""
        pos, slots, lengths, ring_slots, table, ring_table = self.views(meta, B, pool.ring)
        s = self.m.spec
        for i in span:
            if i in pool.windowed:
                at = (ring_slots, ring_table, pool.ring)
            else:
                at = (slots, table, 0)
            self.layer(i, x, pos, lengths, *at, *pool.layer(i), pool.block_size,
                       s.sliding_window if s.sliding(i) else 0)
        return x

    def qkv_bias(self, i: int) -> torch.Tensor | None:
        """Layer i's q | k | v biases joined (once) as matmul_multi takes them, or None."""
        if i not in self._bias:
            lw = self.m.layers[i - self.m.first]
            self._bias[i] = self.tq.join_biases([lw.bq, lw.bk, lw.bv], [w.shape[0] for w in (lw.wq, lw.wk, lw.wv)],
                                                lw.wq.data.device)
        return self._bias[i]

    def layer(self, i, x, pos, lengths, slots, table, ring, kc, vc, bs, window) -> None:
        m, s, tq = self.m, self.m.spec, self.tq
        lw = m.layers[i - m.first]
        B = x.shape[0]
        qkv = tq.matmul_multi(x, [lw.wq, lw.wk, lw.wv], norm=(lw.attn_norm, s.rms_eps), biases=self.qkv_bias(i))
        q = torch.empty(B, s.n_heads, s.head_dim, dtype=torch.float32, device=x.device)
        self.ta.qk_rope_kv_write(qkv, pos, slots, kc, vc, q, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                                 head_dim=s.head_dim, inv_freq=self.inv_freq, rotary_dim=s.rotary_dim,
                                 rope_style="neox" if s.rope_style == "neox" else "interleaved",
                                 attn_factor=self.attn_factor, q_norm=lw.q_norm if s.qk_norm == "head" else None,
                                 k_norm=lw.k_norm if s.qk_norm == "head" else None, eps=s.rms_eps)
        att = torch.empty(B, s.n_heads * s.head_dim, dtype=torch.float32, device=x.device)
        self.ta.decode_attention(q, kc, vc, table, lengths, att, scale=s.softmax_scale, block_size=bs, ring=ring,
                                 window=window, sinks=lw.sinks, max_positions=table.shape[1] * bs)
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
