"""Layers every family shares: linear over stored weights, RMSNorm, RoPE, attention, SwiGLU FFN."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerun.quant.qtypes import FLOAT_QTYPES, QTensor

Weight = torch.Tensor | QTensor


def as_float(w: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A float-typed QTensor as a tensor of `dtype`: a view (plus a cast), no reference dequantizer."""
    return w.data.view(FLOAT_QTYPES[w.qtype]).reshape(w.shape).to(dtype)


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w[out, in].T. A quantized weight is dequantized here (reference path; kernels replace it)."""
    if isinstance(w, QTensor):
        w = as_float(w, x.dtype) if w.qtype in FLOAT_QTYPES else w.dequantize(x.dtype)
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
    mask = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )  # [nh, T, D]
    return out.transpose(0, 1).flatten(1)


def swiglu(x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
    """down(silu(gate x) * up x). x [T, H] -> [T, H]."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)
