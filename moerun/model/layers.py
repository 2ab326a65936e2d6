"""Layers every family shares: RMSNorm, RoPE (plain, partial, YaRN), attention (GQA with optional sinks and a
sliding window; DeepSeek's multi-head latent attention over cached latents, absorbed or expanded). (Matrix
products: moerun.model.ops; the router: moerun.model.moe.)"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moerun.arch.spec import Yarn


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * normalise(x), the normalisation in float32 (as transformers computes it), in one fused op."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_frequencies(dim: int, theta: float, yarn: Yarn | None = None,
                     device: torch.device | None = None) -> torch.Tensor:
    """The inverse frequencies [dim / 2] of RoPE over `dim` rotary dimensions; with YaRN, interpolated by its
    factor below the correction range, extrapolated above it, a linear ramp between (transformers' formula)."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    if yarn is None:
        return 1.0 / base

    def correction(rotations: float) -> float:
        return dim * math.log(yarn.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(yarn.beta_fast), correction(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / max(high - low, 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp  # [dim / 2]: 1 keeps the original frequency, 0 interpolates it
    return (1.0 / (yarn.factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate


def rope_tables(positions: torch.Tensor, dim: int, theta: float, yarn: Yarn | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim / 2] for RoPE over `dim` dimensions at `positions` [T] (scaled by YaRN's attention
    factor when given)."""
    inv_freq = rope_frequencies(dim, theta, yarn, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    if yarn is None or yarn.attention_factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * yarn.attention_factor, freqs.sin() * yarn.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, R/2] for the first R <= D dimensions (the rest pass through: partial
    rotary). neox rotates halves, interleaved rotates adjacent pairs."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin, style), x[..., rot:]), dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if style == "neox":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[T, S] bool: key at k_pos seen from query at q_pos (causal; within the last `window` positions if given)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           scale: float | None = None, sinks: torch.Tensor | None = None, window: int = 0,
           q_start: int | None = None) -> torch.Tensor:
    """Causal GQA attention. q [T, nh, D], k [S, nkv, D], v [S, nkv, Dv], positions [T] and [S] -> [T, nh*Dv].

    scale: of the scores (default D ** -0.5); sinks [nh]: a learned logit per head that joins the softmax's
    denominator and takes no value (gpt-oss); window: each query sees the last `window` positions only.
    k_pos ascending (a cache's positions in order). q_start: q_pos[0] as a host int where the positions are
    consecutive and end together (q_pos = q_start .. q_start+T-1, k_pos = q_start+T-S .. q_start+T-1: a
    sequence's chunk over its cache); with it no position is read from the tensors (on a GPU each read is a
    synchronisation) and a GPU's prompt takes the causal kernels without a mask.

    Forms: decode-sized steps and sinks: _attend_small (a prompt with sinks a QUERY_BLOCK of queries at a
    time); a prompt on a GPU: attend_fused; on the CPU: _attend_blocks."""
    T = q.shape[0]
    if sinks is not None and T > QUERY_BLOCK:  # a prompt: each block of queries against what it sees
        out = []
        for a in range(0, T, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, T)
            lo, hi = _key_bounds(q_pos, k_pos, a, b, window, q_start)
            qs = None if q_start is None else q_start + a
            out.append(_attend_small(q[a:b], k[lo:hi], v[lo:hi], q_pos[a:b], k_pos[lo:hi], scale, sinks, window, qs))
        return torch.cat(out)
    if T <= SMALL_T or sinks is not None:
        return _attend_small(q, k, v, q_pos, k_pos, scale, sinks, window, q_start)
    if q.is_cuda:
        return attend_fused(q, k, v, q_pos, k_pos, scale, window, q_start)
    return _attend_blocks(q, k, v, q_pos, k_pos, scale, window, q_start)


SMALL_T = 16  # decode steps: two batched matmuls beat SDPA's CPU path 7-30x (measured, S = 16..1024)
QUERY_BLOCK = 128  # a prompt's queries go in blocks: each block reads only the keys it sees (causal, window)


def _key_bounds(q_pos, k_pos, a: int, b: int, window: int, q_start: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that queries a..b-1 see: from q_start by arithmetic, searched in host positions, or
    every key where the positions live on a device (reading them there would synchronise)."""
    S = k_pos.shape[0]
    if q_start is not None:
        k0 = q_start + q_pos.shape[0] - S  # k_pos[0]
        return (max(0, q_start + a - window + 1 - k0) if window else 0), q_start + b - k0
    if not q_pos.is_cpu:
        return 0, S
    lo = int(torch.searchsorted(k_pos, q_pos[a] - window + 1)) if window else 0
    return lo, int(torch.searchsorted(k_pos, q_pos[b - 1], right=True))


def _attend_blocks(q, k, v, q_pos, k_pos, scale=None, window=0, q_start=None):
    """A prompt's attention through SDPA, QUERY_BLOCK queries at a time against the keys each block sees, the g
    query heads of a KV head folded into the query length (SDPA's own GQA path and a mask over every key
    were 3.5x slower: 118 vs 34 ms for 512 tokens, 32 heads on 4 KV heads of 128, 2 threads). The CPU's form."""
    T, nh, D = q.shape
    _S, nkv, Dv = v.shape
    g = nh // nkv
    kt, vt = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [nkv, S, D]
    out = []
    for a in range(0, T, QUERY_BLOCK):
        qp = q_pos[a:a + QUERY_BLOCK]
        tb = len(qp)
        lo, hi = _key_bounds(q_pos, k_pos, a, a + tb, window, q_start)
        qb = q[a:a + tb].view(tb, nkv, g, D).permute(1, 2, 0, 3).reshape(nkv, g * tb, D)  # [nkv, g*tb, D]
        mask = visible(qp, k_pos[lo:hi], window).repeat(g, 1)  # [g*tb, hi-lo]
        o = F.scaled_dot_product_attention(qb, kt[:, lo:hi], vt[:, lo:hi], attn_mask=mask, scale=scale)
        out.append(o.view(nkv, g, tb, Dv).permute(2, 0, 1, 3).reshape(tb, nh * Dv))  # [tb, nh*Dv]
    return torch.cat(out)


def attend_fused(q, k, v, q_pos, k_pos, scale=None, window=0, q_start=None):
    """A prompt's attention in one SDPA call that flash / memory-efficient kernels take (a GPU's form; the same
    attention on any device, tested on the CPU): 4-D, in q's dtype, the g query heads of a KV head as the batch
    and the KV heads as views expanded over it (stride 0: no copy; torch 2.13's memory-efficient kernels admit
    no GQA, so enable_gqa with a mask would take the math path and its float32 [nh, T, S] scores; flash
    would take either form). With q_start: is_causal where the queries
    are the keys, lower-right causal after a cached prefix, a mask only for a window's band; without it, the
    mask from the positions (gaps, rings), made on the positions' device. Shapes as attend."""
    T, nh, D = q.shape
    S, nkv, Dv = v.shape
    g = nh // nkv
    k, v = k.to(q.dtype), v.to(q.dtype)
    mask = None
    if q_start is not None:
        k0 = q_start + T - S  # k_pos[0]
        lo = max(0, q_start - window + 1 - k0) if window else 0  # keys older than the first query's window
        k, v, k_pos, S = k[lo:], v[lo:], k_pos[lo:], S - lo
        if window and k0 + lo <= q_start + T - 1 - window:  # the last query's window starts inside the keys
            mask = visible(q_pos, k_pos, window)  # [T, S]
        elif S > T:
            from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: ~0.5 s

            mask = causal_lower_right(T, S)
    else:
        mask = visible(q_pos, k_pos, window)  # [T, S]
    qf = q.view(T, nkv, g, D).permute(2, 1, 0, 3)  # [g, nkv, T, D]
    kf = k.transpose(0, 1)[None].expand(g, nkv, S, D)  # [g, nkv, S, D]
    vf = v.transpose(0, 1)[None].expand(g, nkv, S, Dv)  # [g, nkv, S, Dv]
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o.permute(2, 1, 0, 3).reshape(T, nh * Dv)  # [g, nkv, T, Dv] -> [T, nh*Dv]


def _attend_small(q, k, v, q_pos, k_pos, scale=None, sinks=None, window=0, q_start=None):
    """Attention as two batched matmuls (decode steps, sinks). The mask is skipped where the shapes say nothing
    is masked (one query, q_start given: it is the keys' last position; no window shorter than the keys) or
    host positions say so; device positions are never read: there it is applied whether or not it masks."""
    T, nh, D = q.shape
    S, nkv, Dv = v.shape
    g = nh // nkv  # query heads per KV head
    qg = q.view(T, nkv, g, D).permute(1, 0, 2, 3).reshape(nkv, T * g, D)  # [nkv, T*g, D]
    s = torch.bmm(qg, k.permute(1, 2, 0)) * (D**-0.5 if scale is None else scale)  # [nkv, T*g, S]
    if T > 1 or q_start is None or (window and S > window):
        masked = ~visible(q_pos, k_pos, window)  # [T, S]
        if T > 1 or q_start is not None or not q.is_cpu or bool(masked.any()):
            s = s.view(nkv, T, g, S).masked_fill(masked[None, :, None, :], float("-inf")).view(nkv, T * g, S)
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:  # the sink is one more column of the softmax, dropped after it
        sink = sinks.to(s.dtype).view(nkv, 1, g, 1).expand(nkv, T, g, 1).reshape(nkv, T * g, 1)
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :S]
    o = torch.bmm(p, v.permute(1, 0, 2))  # [nkv, T*g, Dv]
    return o.view(nkv, T, g, Dv).permute(1, 0, 2, 3).reshape(T, nh * Dv)


def mla_form(T: int):
    """The MLA form for T queries: absorbed for small steps (decode; it never expands the S cached latents
    into S * heads keys and values), expanded for prompt chunks (per position and head it multiplies nope +
    rope + v instead of 2 * rank + rope). Measured at V2-Lite's shape, one thread (bench/mla_forms.py,
    bench/RESULTS.md): absorbed faster for every T <= 16, expanded for every T >= 64, at S from T to 4096."""
    return mla_absorbed if T <= SMALL_T else mla_expanded


def mla_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, wk_b: torch.Tensor,
                 wv_b: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
                 q_start: int | None = None) -> torch.Tensor:
    """Multi-head latent attention in the absorbed form: each head's query goes into the latent space through
    its W_UK, attends over the latents as over one shared key and value head, and leaves through its W_UV.

    q_nope [T, nh, nope], q_pe [T, nh, rope] (rotated); latent [S, rank + rope] (the normed compression, then
    the rotated key); wk_b [nh, rank, nope], wv_b [nh, dv, rank] -> [T, nh * dv]; q_start as
    attend's."""
    T, nh, _ = q_nope.shape
    rank = wk_b.shape[1]
    q_lat = torch.bmm(q_nope.transpose(0, 1), wk_b.transpose(1, 2)).transpose(0, 1)  # [T, nh, rank]
    q = torch.cat((q_lat, q_pe), dim=-1)  # [T, nh, rank + rope]
    o = attend(q, latent[:, None], latent[:, None, :rank], q_pos, k_pos, scale, q_start=q_start)  # [T, nh * rank]
    o = torch.bmm(o.view(T, nh, rank).transpose(0, 1), wv_b.transpose(1, 2))  # [nh, T, dv]
    return o.transpose(0, 1).flatten(1)


def mla_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, wk_b: torch.Tensor,
                 wv_b: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
                 q_start: int | None = None) -> torch.Tensor:
    """Multi-head latent attention in the expanded form: every head's keys and values are made from the
    latents (as transformers computes), then plain attention. Shapes as mla_absorbed."""
    nh, rank, _ = wk_b.shape
    S = latent.shape[0]
    c, k_pe = latent[:, :rank], latent[:, rank:]  # [S, rank], [S, rope]
    k = torch.cat((torch.matmul(c, wk_b), k_pe.expand(nh, S, -1)), dim=-1)  # [nh, S, nope + rope]
    v = torch.matmul(c, wv_b.transpose(1, 2))  # [nh, S, dv]
    q = torch.cat((q_nope, q_pe), dim=-1)  # [T, nh, nope + rope]
    return attend(q, k.transpose(0, 1), v.transpose(0, 1), q_pos, k_pos, scale, q_start=q_start)
