"""An independent attention for the tests: float64 softmax attention with its own causal / window mask."""

from __future__ import annotations

import torch


def reference(q, k, v, q_pos, k_pos, scale, sinks=None, window=0):
    """softmax(q k^T * scale, masked; a sink's logit joins the sum) v, per query head, float64 -> [T, nh*Dv]."""
    T, nh, _ = q.shape
    S, nkv, Dv = v.shape
    g = nh // nkv
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)  # [S, nh, D]
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale  # [nh, T, S]
    seen = k_pos[None, :] <= q_pos[:, None]
    if window:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~seen[None], float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double()[:, None, None].expand(nh, T, 1)), dim=-1)
    p = torch.softmax(s, dim=-1)[..., :S]
    return torch.einsum("hts,shd->thd", p, vv).reshape(T, nh * Dv)
