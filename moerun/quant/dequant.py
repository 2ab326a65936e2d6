"""Dequantize GGUF/ggml blocks to float32 in vectorized torch, bit-exact against gguf.quants.

Each type family has one small function `fn(blk, out)`: `blk` is [n, block_bytes] uint8 (n whole
blocks), `out` is a contiguous [n, block_elems] float32 slice that receives the values. The float
arithmetic follows gguf.quants step by step (f16 scales widened to f32 first, products and sums
in the same order, no fused multiply-add), so results match bit for bit. Large tensors are walked
in chunks of blocks so that intermediates stay in cache. The input is never written to.
"""

from __future__ import annotations

import functools

import torch

from moerun.quant import dequant_kquants as k
from moerun.quant.bitfields import (  # noqa: F401 (KV_*, SH_*, scale_min_k4: re-exported)
    KV_IQ4NL,
    KV_MXFP4,
    SH_2BIT,
    SH_BIT,
    SH_NIB,
    as_dtype,
    f16_field,
    inner,
    lookup,
    outer,
    scale_min_k4,
)
from moerun.quant.ggml_types import QType, block_size

__all__ = ["block_dequantizers", "dequantize"]

_U8 = torch.uint8
_F32 = torch.float32

CHUNK_ELEMS = 1 << 18  # weights per chunk: 1 MB of float32 output; intermediates stay in cache


# ----------------------------------------------------------------------------------------- floats


def _f32(data: torch.Tensor) -> torch.Tensor:
    return as_dtype(data, _F32).clone()


def _f16(data: torch.Tensor) -> torch.Tensor:
    h = as_dtype(data, torch.float16)
    out = h.to(_F32)
    nan = out.isnan()
    if nan.any():  # torch quiets signalling NaNs; numpy keeps the payload: widen those bit by bit
        bits = h[nan].view(torch.int16).to(torch.int32)
        sign = (bits & 0x8000) << 16
        out[nan] = (sign | 0x7F800000 | ((bits & 0x3FF) << 13)).view(_F32)
    return out


def _bf16(data: torch.Tensor) -> torch.Tensor:
    return as_dtype(data, torch.bfloat16).to(_F32)  # a 16-bit shift, NaN payloads included


# ----------------------------------------------------------------------------- legacy 32-blocks


def _q4_0(blk: torch.Tensor, out: torch.Tensor) -> None:
    d = f16_field(blk, 0)  # [n, 1]
    q = outer(blk[:, 2:18], SH_NIB, 15).view(-1, 32)  # [n, 32]
    q = q.sub_(8).view(torch.int8)
    torch.mul(d, q.to(_F32), out=out)


def _q4_1(blk: torch.Tensor, out: torch.Tensor) -> None:
    d, m = f16_field(blk, 0), f16_field(blk, 2)  # [n, 1]
    q = outer(blk[:, 4:20], SH_NIB, 15).view(-1, 32)  # [n, 32]
    torch.add(q.to(_F32).mul_(d), m, out=out)


def _q5_low_high(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 5-bit values: nibbles of ql [n, 16] plus bit i of the little-endian u32 qh [n, 4]."""
    lo = outer(ql, SH_NIB, 15).view(-1, 32)  # [n, 32]
    hi = inner(qh, SH_BIT, 1).view(-1, 32)  # [n, 4, 8] -> [n, 32]
    return lo.bitwise_or_(hi.bitwise_left_shift_(4))


def _q5_0(blk: torch.Tensor, out: torch.Tensor) -> None:
    d = f16_field(blk, 0)  # [n, 1]
    q = _q5_low_high(blk[:, 6:22], blk[:, 2:6]).sub_(16).view(torch.int8)  # [n, 32]
    torch.mul(d, q.to(_F32), out=out)


def _q5_1(blk: torch.Tensor, out: torch.Tensor) -> None:
    d, m = f16_field(blk, 0), f16_field(blk, 2)  # [n, 1]
    q = _q5_low_high(blk[:, 8:24], blk[:, 4:8])  # [n, 32]
    torch.add(q.to(_F32).mul_(d), m, out=out)


def _q8_0(blk: torch.Tensor, out: torch.Tensor) -> None:
    d = f16_field(blk, 0)  # [n, 1]
    q = blk[:, 2:34].contiguous().view(torch.int8)  # [n, 32]
    torch.mul(q.to(_F32), d, out=out)


def _iq4_nl(blk: torch.Tensor, out: torch.Tensor) -> None:
    d = f16_field(blk, 0)  # [n, 1]
    q = outer(blk[:, 2:18], SH_NIB, 15).view(-1, 32)  # [n, 32]
    torch.mul(d, lookup(KV_IQ4NL, q), out=out)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2**(e - 128) as f32 (subnormal for e < 2; e = 255 gives 2**127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    return bits.view(_F32)


def _mxfp4(blk: torch.Tensor, out: torch.Tensor) -> None:
    d = e8m0_to_fp32_half(blk[:, 0:1])  # [n, 1]
    q = outer(blk[:, 1:17], SH_NIB, 15).view(-1, 32)  # [n, 32]
    torch.mul(d, lookup(KV_MXFP4, q), out=out)


def _iq4_xs(blk: torch.Tensor, out: torch.Tensor) -> None:
    n = blk.shape[0]
    d = f16_field(blk, 0)  # [n, 1]
    sl = inner(blk[:, 4:8], SH_NIB, 15).view(n, 8)  # byte i -> scales 2i, 2i+1
    sh = inner(blk[:, 2:4], SH_2BIT, 3).view(n, 8)  # u16 LE, 2 bits per scale
    sc = sl.bitwise_or_(sh.bitwise_left_shift_(4)).sub_(32).view(torch.int8)  # [n, 8]
    dl = (d * sc.to(_F32)).unsqueeze(-1)  # [n, 8, 1]
    q = outer(blk[:, 8:136].reshape(n, 8, 16), SH_NIB, 15).view(n, 8, 32)  # [n, 8, 32]
    torch.mul(dl, lookup(KV_IQ4NL, q), out=out.view(n, 8, 32))


# --------------------------------------------------------------------------------------- dispatch


FLOAT_DEQUANTIZERS = {QType.F32: _f32, QType.F16: _f16, QType.BF16: _bf16}


@functools.cache
def block_dequantizers() -> dict:
    """qtype -> block function, built on first use."""
    return {
        QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1, QType.Q8_0: _q8_0,
        QType.Q2_K: k.q2_k, QType.Q3_K: k.q3_k, QType.Q4_K: k.q4_k, QType.Q5_K: k.q5_k, QType.Q6_K: k.q6_k,
        QType.IQ4_NL: _iq4_nl, QType.IQ4_XS: _iq4_xs, QType.MXFP4: _mxfp4,
    }


def dequantize(data: torch.Tensor, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw ggml bytes (uint8, any shape, numel = the tensor's byte size) -> float32 tensor of `shape`.

    Bit-exact with gguf.quants.dequantize. Never writes to `data` (it may be a read-only memory map). Runs on
the device `data` is on.
    Raises ValueError for types it does not know or when the byte count does not fit the shape.
    """
    qtype = QType(qtype)
    shape = tuple(int(s) for s in shape)
    if data.dtype != _U8:
        raise ValueError(f"dequantize wants uint8 bytes, got {data.dtype}")
    fn = block_dequantizers().get(qtype)
    if fn is None and qtype not in FLOAT_DEQUANTIZERS:
        raise ValueError(f"cannot dequantize ggml type {qtype.name}")
    elems, nbytes = block_size(qtype)
    numel = 1
    for s in shape:
        numel *= s
    if (shape and shape[-1] % elems) or data.numel() != numel // elems * nbytes:
        raise ValueError(f"{data.numel()} bytes do not hold a {qtype.name} tensor of shape {shape}")
    if fn is None:
        return FLOAT_DEQUANTIZERS[qtype](data).view(shape)

    nb = numel // elems
    blocks = data.reshape(nb, nbytes)  # a view when data is contiguous
    out = torch.empty(nb, elems, dtype=_F32, device=data.device)
    step = max(1, CHUNK_ELEMS // elems)
    for i in range(0, nb, step):
        fn(blocks[i:i + step], out[i:i + step])
    return out.view(shape)
