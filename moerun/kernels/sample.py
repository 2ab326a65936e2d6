"""The sampler's passes over a vocabulary of logits: C (moerun.kernels._cpu, csrc/sample.c) and a torch twin of each.

Both sides do the same float operations in the same order (csrc/sample.c's header), so a CPU tensor gets the same
bits, and the same token, from either: the C code where the extension is available (one thread, one or two passes
over the logits), the torch twin where it is not (MOERUN_KERNELS=off) and on other devices (where torch's reductions
may order sums otherwise: there the same arithmetic, not the same bits).

    argmax(x)                         greedy's pick: the first index of the largest logit, -1 where one is NaN
    exp32(x)                          Cephes' expf in float32 steps, 0 below -64
    block_sums(w)                     [nb] double: SAMP_BLOCK weights each, 16 lanes then the lanes in order
    norm(x, mx)                       sum of exp32(x - mx) over block_sums, in order (top-p's normaliser)
    draw(x, t, u, cut)                inverse CDF over exp32(x / t - m) where x >= cut -> token index
    cut(x, top_p, log_min_p, bufs)    the smallest logit top-p and min-p keep, or None (C only)
    topk_draw(vals, ids, ...)         top-p, min-p over top-k's sorted candidates, then the draw in token order
"""

from __future__ import annotations

import math

import torch

from moerun.kernels import cpu

BLOCK = 256
BUCKETS = 4096
LANES = 16
CUT_CAP = 16384  # candidates in the two buckets around top-p's cut sorted at most (more: the caller sorts)

_LOG2E, _C1, _C2 = 1.44269504088896341, 0.693359375, -2.12194440e-4
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_ROUND = 12582912.0  # 1.5 * 2^23: (y + _ROUND) - _ROUND rounds y to an integer, ties to even


def f32(v: float) -> float:
    """v rounded to float32 (as a Python float): the constants both sides use."""
    return float(torch.tensor(v, dtype=torch.float32))


_LOG2E, _C2 = f32(_LOG2E), f32(_C2)
_P = tuple(f32(c) for c in _P)


def available(x: torch.Tensor) -> bool:
    """Whether the C passes take logits x (float32, contiguous, on the CPU, the extension built and not disabled)."""
    return cpu.available() and x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()


def _isa() -> int:
    return cpu._isa(None)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """[n] float32 -> [n] float32, csrc/sample.c's exp32 step by step."""
    xc = torch.where(x >= -64.0, x, -64.0)
    n = (xc * _LOG2E + _ROUND) - _ROUND
    r = (xc - n * _C1) - n * _C2
    p = torch.full_like(r, _P[0])
    for c in _P[1:]:
        p = p * r + c
    e = (p * (r * r) + r) + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x >= -64.0, e * scale, 0.0)


def block_sums(w: torch.Tensor) -> torch.Tensor:
    """w [n] float32 -> [nb] float64: each block's sum in csrc/sample.c's order (torch.cumsum sums in order on the
    CPU)."""
    nb = -(-w.numel() // BLOCK)
    rows = torch.zeros(nb * BLOCK, dtype=torch.float64, device=w.device)
    rows[:w.numel()] = w
    lanes = rows.view(nb, BLOCK // LANES, LANES).cumsum(1)[:, -1]  # [nb, LANES]
    return lanes.cumsum(1)[:, -1]


def argmax(x: torch.Tensor) -> int:
    """The first index of x's [n] largest value (torch.argmax's), or -1 where x holds a NaN: one pass in C, where
    torch takes two (argmax, then the NaN check) and ~0.2 ms over 150k logits just written by a decode step."""
    if available(x):
        return cpu._cpu.sample_argmax(_isa(), x.data_ptr(), x.numel())
    return -1 if bool(x.isnan().any()) else int(torch.argmax(x))


def norm(x: torch.Tensor, mx: torch.Tensor | float) -> torch.Tensor:
    """Sum of exp32(x - mx), [] float32, as both sides compute it."""
    if available(x):
        return torch.tensor(cpu._cpu.sample_norm(_isa(), x.data_ptr(), x.numel(), float(mx)), dtype=torch.float32)
    return block_sums(exp32(x - mx)).cumsum(0)[-1].float()


def draw(x: torch.Tensor, t: float, u: torch.Tensor, cut: float = -math.inf) -> torch.Tensor:
    """One token index from x [n] (truncated logits, -inf where dropped; also dropped: x < cut), at temperature t
    (float32), with u [1] float64 uniform. -> 0-d long on x's device."""
    if available(x):
        j = cpu._cpu.sample_draw(_isa(), x.data_ptr(), x.numel(), t, cut, float(u))
        if j >= 0:
            return torch.tensor(j)
    if cut > -math.inf:
        x = x.masked_fill(x < cut, -math.inf)
    scaled = x / t
    m = scaled.max()
    # +inf logits share the draw; elsewhere weights exp32(scaled - m)
    w = torch.where(torch.isposinf(m), (scaled == m).float(), exp32(scaled - m))  # [n]
    sums = block_sums(w)  # [nb]
    cum = torch.zeros(sums.numel() + 1, dtype=torch.float64, device=x.device)
    torch.cumsum(sums, 0, out=cum[1:])
    target = u * cum[-1]  # [1]
    last = (cum[1:] < cum[-1]).sum().view(1)  # [1] the last block holding weight
    b = torch.minimum(torch.searchsorted(cum[1:], target, right=True), last)  # [1]
    rows = torch.zeros(sums.numel() * BLOCK, device=x.device)
    rows[:w.numel()] = w
    within = rows.view(-1, BLOCK).index_select(0, b).view(-1).double().cumsum_(0).add_(cum.index_select(0, b))
    j = torch.minimum(torch.searchsorted(within, target, right=True), (within < within[-1]).sum().view(1))
    return (b * BLOCK + j).view(())


class CutBuffers:
    """Scratch for `cut` over one vocabulary size (held by the caller, reused by every call)."""

    def __init__(self):
        self.hist = torch.empty(BUCKETS + 1, dtype=torch.float64)
        self.keys = torch.empty(2 * CUT_CAP, dtype=torch.int32)


def cut(x: torch.Tensor, top_p: float | None, log_min_p: float | None, bufs: CutBuffers) -> float | None:
    """The smallest logit top-p (float32 threshold) and min-p (float32 log) keep over the whole of x [n]
    (available(x) only), as the sorted chain keeps them; None where a tie or rounding at the cut, or logits not
    finite, leave it to the chain."""
    return cpu._cpu.sample_cut(_isa(), x.data_ptr(), x.numel(), top_p or 0.0, top_p is not None, log_min_p or 0.0,
                               log_min_p is not None, bufs.hist.data_ptr(), bufs.keys.data_ptr(), CUT_CAP)


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [C] sorted descending -> keep [C] bool: each token whose probability mass ranked above it (summed in
    double in rank order, rounded to float32) is under top_p; the first always."""
    before = torch.cumsum(probs, dim=0) - probs  # [C]
    keep = before < top_p
    keep[0] = True
    return keep


def topk_draw(vals: torch.Tensor, ids: torch.Tensor, t: float, top_p: float | None, log_min_p: float | None,
              u: torch.Tensor) -> torch.Tensor:
    """vals [k] sorted descending, ids [k]: top-p, then min-p, then the draw over the k in token order (dropped
    ones -inf). -> 0-d long token id."""
    if available(vals) and ids.dtype == torch.long and ids.is_contiguous():
        k = vals.numel()
        sv, sid = torch.empty(k), torch.empty(k, dtype=torch.long)
        j = cpu._cpu.sample_topk(_isa(), vals.data_ptr(), ids.data_ptr(), k, t, top_p or 0.0, top_p is not None,
                                 log_min_p or 0.0, log_min_p is not None, float(u), sv.data_ptr(), sid.data_ptr())
        if j >= 0:
            return torch.tensor(j)
    vals = truncate_sorted(vals, top_p, log_min_p)
    ids, order = torch.sort(ids)
    return ids.gather(0, draw(vals.gather(0, order), t, u).view(1)).view(())


def truncate_sorted(vals: torch.Tensor, top_p: float | None, log_min_p: float | None,
                    nrm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Top-p then min-p over vals [C] sorted descending (-inf where dropped); nrm: (max, norm) of the whole
    vocabulary when vals is a head of it, else vals' own."""
    if top_p is not None:
        mx, z = nrm if nrm is not None else (vals[0], norm(vals, vals[0]))
        vals = vals.masked_fill(~top_p_keep(exp32(vals - mx) / z, top_p), -math.inf)
    if log_min_p is not None:
        vals = vals.masked_fill(vals < vals[0] + log_min_p, -math.inf)
    return vals
