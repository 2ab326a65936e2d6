"""Layers every family shares: RMSNorm, RoPE, attention. (Matrix products: moerun.model.ops.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * normalise(x), the normalisation in float32 (as transformers computes it), in one fused op."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                 / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D/2]. neox rotates halves, interleaved rotates adjacent pairs."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if style == "neox":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           ) -> torch.Tensor:
    """Causal GQA attention. q [T, nh, D], k/v [S, nkv, D], positions [T] and [S] -> [T, nh*D]."""
    if q.shape[0] <= SMALL_T:
        return _attend_small(q, k, v, q_pos, k_pos)
    mask = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )  # [nh, T, D]
    return out.transpose(0, 1).flatten(1)


SMALL_T = 16  # decode steps: two batched matmuls beat SDPA's CPU path 7-30x (measured, S = 16..1024)


def _attend_small(q, k, v, q_pos, k_pos):
    T, nh, D = q.shape
    S, nkv, _ = k.shape
    g = nh // nkv  # query heads per KV head
    qg = q.view(T, nkv, g, D).permute(1, 0, 2, 3).reshape(nkv, T * g, D)  # [nkv, T*g, D]
    s = torch.bmm(qg, k.permute(1, 2, 0)) * D**-0.5  # [nkv, T*g, S]
    masked = k_pos[None, :] > q_pos[:, None]  # [T, S]
    if T > 1 or bool(masked.any()):
        s = s.view(nkv, T, g, S).masked_fill(masked[None, :, None, :], float("-inf")).view(nkv, T * g, S)
    o = torch.bmm(torch.softmax(s, dim=-1), v.permute(1, 0, 2))  # [nkv, T*g, D]
    return o.view(nkv, T, g, D).permute(1, 0, 2, 3).reshape(T, nh * D)
