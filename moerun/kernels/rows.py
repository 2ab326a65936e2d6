"""The layer loop's per-row pieces in the fused C layers' arithmetic (csrc/attn.c, csrc/layer.c): RMSNorm, RoPE,
the sigmoid output gate, a few rows' attention over float32 keys and values, and the router's choice. The torch
layer loop takes these on the CPU (moerun.model.ops.KernelOps), so a decode step gives the same bits through the
loop as through one C call, whatever the composition: greedy tokens cannot part on a 1-ulp difference. Norms, RoPE
and the gate work row by row, and a prompt takes them too: a row gets the same bits in a step of any size.
moerun.model.layers and moerun.model.moe hold the torch forms (devices, no kernels), which the tests compare these
with."""

from __future__ import annotations

import torch

from moerun.kernels.cpu import _cpu, _isa
from moerun.kernels.layer import GATINGS, GROUP_SCORES

__all__ = ["attend", "gate_mul", "mla", "rms_norm", "rope", "route"]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / rms(x) over the last dimension (the mean of squares in double), as the fused layers compute it."""
    n = x.shape[-1]
    if w.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(w.shape)} for rows of {n}")
    x, w = _f32(x), _f32(w)
    out = torch.empty_like(x)
    _cpu.rms_norm_rows(x.data_ptr(), w.data_ptr(), x.numel() // n, n, eps, out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [T, heads, D] rotated over its first R = 2 * cos.shape[-1] dimensions a head (cos, sin [T, R / 2])."""
    T, heads, D = x.shape
    R = 2 * cos.shape[-1]
    if cos.shape != (T, R // 2) or sin.shape != cos.shape or R > D:
        raise ValueError(f"rope: tables {tuple(cos.shape)} for x {tuple(x.shape)}")
    out, cos, sin = x.float().contiguous().clone(), _f32(cos), _f32(sin)
    _cpu.rope_rows(out.data_ptr(), T, heads, D, cos.data_ptr(), sin.data_ptr(), R, int(neox))
    return out


def gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), elementwise."""
    if x.shape != gate.shape:
        raise ValueError(f"gate_mul: {tuple(x.shape)} against {tuple(gate.shape)}")
    out, gate = x.float().contiguous().clone(), _f32(gate)
    _cpu.gate_mul(out.data_ptr(), gate.data_ptr(), out.numel())
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int, scale: float | None,
           sinks: torch.Tensor | None, window: int, isa: str | None = None) -> torch.Tensor:
    """One sequence's T queries q [T, nh, D] at positions q_start.. over its keys and values k, v [S, nkv, D] at
    positions k_start.. (the last query's position is k_start + S - 1) -> [T, nh * D], causal, within the last
    `window` positions when window > 0, with sinks [nh] in the softmax's denominator."""
    T, nh, D = q.shape
    S, nkv = k.shape[0], k.shape[1]
    if v.shape != k.shape or k.shape[2] != D or nh % nkv or q_start + T != k_start + S or k_start < 0 \
            or (k_start > 0 and not window) or (window and k_start > max(0, q_start - window + 1)):
        raise ValueError(f"attend: q {tuple(q.shape)} at {q_start}, k {tuple(k.shape)} at {k_start}")
    q, k, v = _f32(q), _f32(k), _f32(v)
    sinks = None if sinks is None else _f32(sinks)
    table = torch.arange(-k_start, S, dtype=torch.int64)  # position p's row: p - k_start
    slots = torch.tensor([table.data_ptr()] * T, dtype=torch.int64)
    pos = torch.arange(q_start, q_start + T, dtype=torch.int64)
    att = torch.empty(T, nh * D)
    _cpu.attend_rows(_isa(isa), q.data_ptr(), T, nh, nkv, D, k.data_ptr(), v.data_ptr(), slots.data_ptr(),
                     pos.data_ptr(), window, 0 if sinks is None else sinks.data_ptr(),
                     0.0 if scale is None else scale, att.data_ptr())
    return att


def mla(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, wk_b: torch.Tensor, wv_b: torch.Tensor,
        q_start: int, scale: float | None, isa: str | None = None) -> torch.Tensor:
    """MLA's absorbed attention as the fused layers compute it: one sequence's T queries q_nope [T, nh, nope],
    q_pe [T, nh, R] (rotated) at positions q_start.. over its latents [S, rank + R] at positions 0..S-1 (S =
    q_start + T), W_UK wk_b [nh, rank, nope], W_UV wv_b [nh, dv, rank] (float32) -> [T, nh * dv]."""
    T, nh, nope = q_nope.shape
    R, (S, L), rank, dv = q_pe.shape[-1], latent.shape, wk_b.shape[1], wv_b.shape[1]
    if q_pe.shape[:2] != (T, nh) or L != rank + R or q_start + T != S or wk_b.shape != (nh, rank, nope) \
            or wv_b.shape != (nh, dv, rank):
        raise ValueError(f"mla: q {tuple(q_nope.shape)} + {tuple(q_pe.shape)} at {q_start}, latents {(S, L)}, "
                         f"W_UK {tuple(wk_b.shape)}, W_UV {tuple(wv_b.shape)}")
    q = torch.cat((q_nope, q_pe), dim=-1).float().contiguous()
    latent, wk_b, wv_b = _f32(latent), _f32(wk_b), _f32(wv_b)
    table = torch.arange(S, dtype=torch.int64)
    slots = torch.tensor([table.data_ptr()] * T, dtype=torch.int64)
    pos = torch.arange(q_start, q_start + T, dtype=torch.int64)
    o = torch.empty(T, nh * dv)
    _cpu.mla_rows(_isa(isa), q.data_ptr(), T, nh, rank, R, nope, dv, wk_b.data_ptr(), wv_b.data_ptr(),
                  latent.data_ptr(), slots.data_ptr(), pos.data_ptr(), 0.0 if scale is None else scale, o.data_ptr())
    return o


def route(logits: torch.Tensor, spec, score_b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's spec.n_experts_used experts of logits [T, E] (the router's bias added) -> weights [T, k], ids
    [T, k], best first, as moerun.model.moe.route chooses and weighs them."""
    T, E = logits.shape
    k = spec.n_experts_used
    x = logits.float().contiguous().clone()  # used up
    sb = None if score_b is None else _f32(score_b)
    ids, w = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    _cpu.route_rows(x.data_ptr(), T, E, k, GATINGS[spec.router], 0 if sb is None else sb.data_ptr(),
                    max(1, spec.n_groups), max(1, spec.topk_groups), GROUP_SCORES[spec.group_score],
                    int(bool(spec.norm_topk)), float(spec.routed_scale), ids.data_ptr(), w.data_ptr())
    return w, ids
