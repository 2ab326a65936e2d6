"""Quantize float tensors to ggml block formats in vectorized torch.

F32, F16, BF16, Q8_0 and Q4_0 reproduce gguf.quants.quantize byte for byte (same float operations,
same round-half-away-from-zero). gguf.quants cannot quantize K-quants; Q4_K and Q6_K here are simple
vectorized quantizers (min/max or absmax start, a few least-squares refits) whose bytes are checked
against gguf.quants.dequantize in the tests. Large inputs are processed in chunks of blocks, so
memory beyond the output stays bounded.
"""

from __future__ import annotations

import torch

from moerun.quant.dequant import KV_MXFP4, e8m0_to_fp32_half
from moerun.quant.qtypes import QType, block_size

__all__ = ["quantize"]

_F32, _F16, _U8 = torch.float32, torch.float16, torch.uint8

CHUNK_ELEMS = 1 << 18  # weights per chunk: temporaries of 1 MB each; fewer, larger torch calls pay off
Q4_K_STEPS = (-0.5, 0.0, 0.5)  # Q4_K start points: step = (max - min) / (15 + c), best fit kept
Q4_K_REFITS = 2  # least-squares refits (at least 1) of each sub-block's (scale, min) per start point


# ----------------------------------------------------------------------------------------- helpers


def roundf(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero with gguf.quants.np_roundf's exact float operations."""
    a = v.abs()
    fl = a.floor()
    return v.sign() * (fl + (2 * (a - fl)).floor())


def f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """[n, 1] float -> [n, 2] uint8, the little-endian f16."""
    return v.to(_F16).view(_U8)


def safe_inv(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d == 0 (as gguf.quants: np.where(d == 0, 0, 1 / d))."""
    return torch.where(d == 0, 0.0, 1 / d)


def signed_absmax(v: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude along the last axis, sign kept (first one on ties): [..., 1]."""
    return v.gather(-1, v.abs().argmax(-1, keepdim=True))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 2, L] uint8 values < 16 -> [..., L] bytes, first row in the low nibble."""
    return q[..., 0, :] | (q[..., 1, :] << 4)


# ---------------------------------------------------------------------------------------- floats


def _float_bytes(x: torch.Tensor, qtype: QType) -> torch.Tensor:
    """Round to nearest even, as numpy (F16) and gguf.quants (BF16) do, NaN payloads included.

    Inputs go through float32 first (exact for f16/bf16/f32 inputs). The result never aliases x.
    """
    if qtype == QType.F32:
        v = x.to(_F32, memory_format=torch.contiguous_format, copy=True)
        return v.view(_U8).reshape(*x.shape[:-1], -1)
    v = x.to(_F32).contiguous()
    target = _F16 if qtype == QType.F16 else torch.bfloat16
    bits = v.to(target).view(torch.int16)
    nan = v.isnan()
    if nan.any():  # torch makes every NaN the canonical one; numpy and gguf keep sign and high payload
        f = v.view(torch.int32)
        if qtype == QType.F16:  # numpy: sign | 0x7c00 + (mantissa >> 13), never an infinity
            keep = ((f & 0x007FFFFF) >> 13).clamp_(min=1)
            nan_bits = ((f >> 16) & 0x8000) | 0x7C00 | keep
        else:  # gguf.quants BF16: high half with the quiet bit forced
            nan_bits = (f >> 16) | 0x40
        bits = torch.where(nan, nan_bits.to(torch.int16), bits)
    return bits.view(_U8).reshape(*x.shape[:-1], -1)


# ------------------------------------------------------------------------------ 32-element blocks


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """[n, 32] -> [n, 34]: f16 d = absmax / 127, int8 round(x / d)."""
    d = x.abs().amax(-1, keepdim=True) / 127  # [n, 1]
    q = roundf(x * safe_inv(d)).to(torch.int8)  # [n, 32]
    return torch.cat([f16_bytes(d), q.view(_U8)], dim=-1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    """[n, 32] -> [n, 18]: f16 d = -signed_absmax / 8, nibbles trunc(x / d + 8.5) clamped to 15."""
    d = signed_absmax(x) / -8  # [n, 1]
    q = torch.trunc(x * safe_inv(d) + 8.5).to(_U8).clamp_(0, 15)  # [n, 32]
    return torch.cat([f16_bytes(d), pack_nibbles(q.view(-1, 2, 16))], dim=-1)


def _mxfp4(x: torch.Tensor) -> torch.Tensor:
    """[n, 32] -> [n, 17]: E8M0 e = floor(log2 absmax) - 2 + 127 (0 for an all-zero block), then each value's
    nearest of the (doubled) code book times 2^(e - 128) (the first on ties), nibbles as Q4_0 (gguf.quants' choice)."""
    d = x.abs().amax(-1, keepdim=True)  # [n, 1]
    e = torch.where(d > 0, torch.floor(torch.log2(d)) - 2 + 127, 0.0).to(torch.int32).to(_U8)
    scale = e8m0_to_fp32_half(e)  # [n, 1]
    err = (scale[..., None] * KV_MXFP4 - x[..., None]).abs()  # [n, 32, 16]
    q = err.argmin(-1).to(_U8)  # [n, 32]: argmin takes the first of equal errors, as numpy's
    return torch.cat([e, pack_nibbles(q.view(-1, 2, 16))], dim=-1)


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hugging Face MXFP4 (gpt-oss's `*_blocks` [.., G, 16] uint8, value 2i in byte i's low nibble and 2i + 1 in its
    high one; `*_scales` [.., G] uint8 E8M0) -> GGUF MXFP4 bytes [.., G * 17] (the same exponent byte, the
    same 4-bit codes; byte j holds values j and j + 16). Lossless."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)  # [.., G, 32] in value order
    return torch.cat((scales[..., None], pack_nibbles(codes.unflatten(-1, (2, 16)))), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------- Q4_K


def _fit_scale_min(x, q, sx, sxx, s, m):
    """Least-squares (s, m) of x ~ s*q - m per sub-block (m >= 0) and its squared error.

    x, q: [n, 8, 32]; sx, sxx (sums of x, x*x), s, m (the fit that gave q): [n, 8]. Where the fit is
    degenerate (all q equal) the old (s, m) is kept. The error comes from the sums, without a pass.
    """
    k = x.shape[-1]
    sq, sqq, sqx = q.sum(-1), (q * q).sum(-1), (q * x).sum(-1)
    det = k * sqq - sq * sq
    s_new = (k * sqx - sq * sx) / det
    m_new = (s_new * sq - sx) / k
    neg = m_new < 0  # the free fit wants a negative min: refit with m = 0
    s_new = torch.where(neg, sqx / sqq, s_new)
    m_new = torch.where(neg, 0.0, m_new)
    ok = (det > 0) & (s_new > 0)
    s, m = torch.where(ok, s_new, s), torch.where(ok, m_new, m)
    err = s * s * sqq + k * m * m + sxx - 2 * s * m * sq - 2 * s * sqx + 2 * m * sx  # sum (s*q - m - x)^2
    return s, m, err


def _q4_levels(x: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """round((x + m) / s) clamped to [0, 15], 0 where s == 0: [n, 8, 32] float."""
    return (x + m.unsqueeze(-1)).mul_(safe_inv(s).unsqueeze(-1)).round_().clamp_(0, 15)


def _six_bit(v: torch.Tensor, d: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative [n, 8] -> (f16 super-scale d [n, 1], 6-bit levels [n, 8] float), v ~ d * level."""
    if d is None:
        d = (v.amax(-1, keepdim=True) / 63).to(_F16)
    return d, (v * safe_inv(d.to(_F32))).round_().clamp_(0, 63)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    """[n, 256] -> [n, 144]: per 32 weights x ~ d*sc*q - dmin*m, sc and m 6-bit, q 4-bit.

    Each sub-block starts from min/max (min clamped to <= 0) with a few step sizes, refits (scale, min)
    by least squares and keeps the best; then scales and mins are rounded to 6 bits under f16 super
    scales, refit once more with the rounded values, and the weights requantized.
    """
    n = x.shape[0]
    xs = x.view(n, 8, 32)
    sx, sxx = xs.sum(-1), (xs * xs).sum(-1)  # [n, 8]
    lo, hi = xs.amin(-1).clamp_(max=0), xs.amax(-1)  # [n, 8] (torch.aminmax is 6x slower here)
    best = None
    for c in Q4_K_STEPS:
        s, m = (hi - lo) / (15 + c), -lo  # [n, 8]
        for _ in range(Q4_K_REFITS):
            s, m, err = _fit_scale_min(xs, _q4_levels(xs, s, m), sx, sxx, s, m)
        if best is None:
            best = s, m, err
        else:
            better = err < best[2]
            best = tuple(torch.where(better, new, old) for new, old in zip((s, m, err), best))
    s, m = best[0], best[1]
    d, sc = _six_bit(s)  # [n, 1] f16, [n, 8]
    dmin, mn = _six_bit(m)
    s, m = d.to(_F32) * sc, dmin.to(_F32) * mn
    s, m, _ = _fit_scale_min(xs, _q4_levels(xs, s, m), sx, sxx, s, m)  # refit with 6-bit rounding in view
    _, sc = _six_bit(s, d)
    _, mn = _six_bit(m, dmin)
    q = _q4_levels(xs, d.to(_F32) * sc, dmin.to(_F32) * mn).to(_U8)  # [n, 8, 32]

    sc, mn = sc.to(_U8), mn.to(_U8)  # [n, 8]
    scales = torch.cat([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),  # bytes 0-3: sc[0:4], top bits of sc[4:8]
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),  # bytes 4-7: mn[0:4], top bits of mn[4:8]
        (sc[:, 4:] & 15) | (mn[:, 4:] << 4),  # bytes 8-11: low nibbles of sc[4:8], mn[4:8]
    ], dim=-1)  # [n, 12]
    qs = pack_nibbles(q.view(n, 4, 2, 32)).view(n, 128)  # weights 64g + j (low), 64g + 32 + j (high)
    return torch.cat([d.view(_U8), dmin.view(_U8), scales, qs], dim=-1)


# ---------------------------------------------------------------------------------------- Q6_K


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    """[n, 256] -> [n, 210]: per 16 weights x ~ d*sc*q, sc int8, q in [-32, 31]."""
    n = x.shape[0]
    xs = x.view(n, 16, 16)
    s = signed_absmax(xs).squeeze(-1) / -32  # [n, 16]: the extreme weight maps to -32
    d = (signed_absmax(s) / -128).to(_F16)  # [n, 1]: the extreme scale maps to -128
    df = d.to(_F32)
    ls = (s * safe_inv(df)).round_().clamp_(-128, 127)  # [n, 16]
    q = (xs * safe_inv(df * ls).unsqueeze(-1)).round_().clamp_(-32, 31)  # [n, 16, 16]
    # one least-squares refit of each integer scale with q fixed, then requantize
    fit = (q * xs).sum(-1) / (q * q).sum(-1)  # [n, 16]
    ls = torch.where(fit.isfinite(), fit * safe_inv(df), ls).round_().clamp_(-128, 127)
    q = (xs * safe_inv(df * ls).unsqueeze(-1)).round_().clamp_(-32, 31)

    q6 = (q + 32).to(_U8).view(n, 2, 4, 32)  # weight 128h + 32k + j
    ql = pack_nibbles((q6 & 15).view(n, 2, 2, 64)).view(n, 128)  # low nibbles: 128h + j | 128h + 64 + j
    hb = q6 >> 4  # [n, 2, 4, 32] high 2 bits
    qh = (hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)).view(n, 64)
    return torch.cat([ql, qh, ls.to(torch.int8).view(_U8), d.view(_U8)], dim=-1)


# --------------------------------------------------------------------------------------- dispatch

BLOCK_QUANTIZERS = {QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_K: _q4_k, QType.Q6_K: _q6_k, QType.MXFP4: _mxfp4}
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)


def quantize(x: torch.Tensor, qtype: QType) -> torch.Tensor:
    """Float tensor [..., n] -> uint8 [..., n // block_elems * block_bytes] of ggml type `qtype`.

    n must be a multiple of the block size. Raises ValueError for types this module cannot produce.
    """
    qtype = QType(qtype)
    if not x.is_floating_point():
        raise ValueError(f"quantize wants a float tensor, got {x.dtype}")
    if qtype in FLOAT_TYPES:
        return _float_bytes(x, qtype)
    fn = BLOCK_QUANTIZERS.get(qtype)
    if fn is None:
        raise ValueError(f"cannot quantize to ggml type {qtype.name}")
    elems, nbytes = block_size(qtype)
    n = x.shape[-1] if x.dim() else 1
    if n % elems:
        raise ValueError(f"rows of {n} weights are not a multiple of {qtype.name}'s block of {elems}")
    blocks = x.contiguous().view(-1, elems)  # [nb, elems]; blocks never straddle rows
    out = torch.empty(blocks.shape[0], nbytes, dtype=_U8)
    step = max(1, CHUNK_ELEMS // elems)
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = fn(blocks[i:i + step].to(_F32))
    return out.view(*x.shape[:-1], n // elems * nbytes)
