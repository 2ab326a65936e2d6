"""Gated DeltaNet in C. The decode step (csrc/deltanet.c): the conv1d window, the delta rule and the gated norm
of B sequences, one position each, in one call that updates their pool slots in place. The prompt's delta rule
(csrc/deltanet_prompt.c): one sequence's T positions by the recurrence (and the gated norm), its state updated
in place; likewise the prompt's conv1d.
moerun.model.deltanet is the torch form they are tested against (and what runs elsewhere: devices, no kernels)."""

from __future__ import annotations

import torch

from moerun.kernels.cpu import _cpu, _isa, available

__all__ = ["conv_prompt", "delta_prompt", "delta_step", "usable"]


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


def _rows(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """t [T, heads, d] float32 on the CPU, each position's [heads, d] contiguous -> (t, floats between positions)."""
    if t.dtype != torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be a float32 CPU tensor")
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
        t = t.contiguous()
    return t, t.stride(0)


def delta_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, order: str = "grouped", gate: tuple | None = None, *,
                 isa: str | None = None) -> torch.Tensor:
    """deltanet.delta_steps in one call: q, k [T, nk, dk] (before their L2 norm; positions may be rows of a wider
    tensor), v [T, nv, dv], g (log decay) and beta [T, nv]; state [nv, dk, dv] float32, updated in place
    -> o [T, nv, dv] float32; with gate = (z [T, nv, dv], norm [dv], eps): deltanet.gated_norm(o, norm, z, eps)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or g.dim() != 2 or beta.dim() != 2 or state.dim() != 3:
        raise ValueError("delta_prompt: q, k, v must be [T, heads, d], g and beta [T, nv], state [nv, dk, dv]")
    (T, nk, dk), (nv, dv) = q.shape, v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, nv) or beta.shape != (T, nv) \
            or state.shape != (nv, dk, dv) or nk < 1 or nv % nk or dk < 1 or dv < 1:
        raise ValueError(f"delta_prompt: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)} do not agree")
    if order not in ("grouped", "tiled"):
        raise ValueError(f"delta_prompt: order must be 'grouped' or 'tiled', got {order!r}")
    z, sz, norm, eps = None, 0, None, 0.0
    if gate is not None:
        z, norm, eps = gate
        if z.dim() != 3 or z.shape != v.shape or norm.shape != (dv,):
            raise ValueError(f"delta_prompt: the gate z {tuple(z.shape)}, norm {tuple(norm.shape)} do not fit v "
                             f"{tuple(v.shape)}")
        (z, sz), norm = _rows(z, "z"), _c(norm.contiguous(), "norm")
    out = torch.empty((T, nv, dv))
    if T == 0:
        return out
    (q, sq), (k, sk), (v, sv) = _rows(q, "q"), _rows(k, "k"), _rows(v, "v")
    g, beta, state = _c(g.contiguous(), "g"), _c(beta.contiguous(), "beta"), _c(state, "state")
    _cpu.delta_prompt(_isa(isa), T, nk, nv, dk, dv, sq, sk, sv, int(order == "tiled"), q.data_ptr(), k.data_ptr(),
                      v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(), 0 if z is None else z.data_ptr(),
                      sz, 0 if norm is None else norm.data_ptr(), float(eps), out.data_ptr())
    return out


def conv_prompt(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """deltanet.conv_prompt in one call: x [T, C] float32 (rows may be strided), w [C, K] (K <= 16), state [C, K-1]
    float32, replaced in place by the last K - 1 inputs -> y [T, C] (after SiLU)."""
    if x.dim() != 2 or w.dim() != 2 or state.dim() != 2:
        raise ValueError("conv_prompt: x must be [T, C], w [C, K], state [C, K-1]")
    (T, C), K = x.shape, w.shape[1]
    if w.shape[0] != C or state.shape != (C, K - 1) or not 1 <= K <= 16:
        raise ValueError(f"conv_prompt: x {tuple(x.shape)}, w {tuple(w.shape)}, state {tuple(state.shape)} do not "
                         "agree (K <= 16)")
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError("x must be a float32 CPU tensor")
    x = x if x.stride(1) == 1 else x.contiguous()
    w, state = _c(w.contiguous(), "w"), _c(state, "state")
    y = torch.empty((T, C))
    if T:
        _cpu.delta_conv_prompt(T, C, K, x.data_ptr(), x.stride(0), w.data_ptr(), state.data_ptr(), y.data_ptr())
    return y
