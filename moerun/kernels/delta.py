"""Gated DeltaNet's decode step in C (csrc/deltanet.c): the conv1d window, the delta rule and the gated norm
of B sequences, one position each, in one call that updates their pool slots in place. moerun.model.deltanet
is the torch form it is tested against (and what runs elsewhere: prompts, devices, no kernels)."""

from __future__ import annotations

import torch

from moerun.kernels.cpu import _cpu, available

__all__ = ["delta_step", "usable"]


def usable(*tensors: torch.Tensor) -> bool:
    """The kernel runs here: built, and every tensor a float32 CPU one."""
    return available() and all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


def _c(t: torch.Tensor, name: str, dtype=torch.float32) -> torch.Tensor:
    if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")
    return t


def delta_step(qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor, conv: torch.Tensor,
               ssm: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, w: torch.Tensor, a: torch.Tensor,
               dt: torch.Tensor, norm: torch.Tensor, eps: float, n_k_heads: int, tiled: bool) -> torch.Tensor:
    """qkv [B, C] (before the conv1d), z [B, nv * dv], beta and alpha logits [B, nv]; the pool's conv windows
    [slots, C, K-1] and states [slots, nv, dk, dv], updated in place at `slots` [B] (int64; `fresh` [B] bool:
    start from zeros); w [C, K], a and dt [nv], norm [dv] -> the gated, normed output [B, nv * dv]."""
    B, C = qkv.shape
    _, nv, dk, dv = ssm.shape
    K = w.shape[1]
    if conv.shape[1:] != (C, K - 1) or z.shape != (B, nv * dv) or beta.shape != (B, nv) or alpha.shape != (B, nv) \
            or slots.shape != (B,) or fresh.shape != (B,) or C != 2 * n_k_heads * dk + nv * dv:
        raise ValueError("delta_step: shapes do not agree")
    if int(slots.min()) < 0 or int(slots.max()) >= ssm.shape[0] or conv.shape[0] != ssm.shape[0]:
        raise ValueError("delta_step: a slot is out of the pool's range")
    args = [_c(t, n) for t, n in ((qkv, "qkv"), (z, "z"), (beta, "beta"), (alpha, "alpha"), (conv, "conv"),
                                  (ssm, "ssm"))]
    args += [_c(slots, "slots", torch.int64), _c(fresh.to(torch.uint8), "fresh", torch.uint8)]
    args += [_c(t, n) for t, n in ((w, "w"), (a, "a"), (dt, "dt"), (norm, "norm"))]
    y, out = torch.empty((B, C)), torch.empty((B, nv * dv))
    _cpu.delta_step(B, C, K, n_k_heads, nv, dk, dv, int(tiled), *(t.data_ptr() for t in args), float(eps),
                    y.data_ptr(), out.data_ptr())
    return out
