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

from moerun.quant.qtypes import QType, block_size

__all__ = ["block_dequantizers", "dequantize"]

_U8 = torch.uint8
_F32 = torch.float32

# Bit offsets of the fields packed in one byte (first field in the low bits).
SH_NIB = torch.tensor([0, 4], dtype=_U8)  # two nibbles
SH_2BIT = torch.tensor([0, 2, 4, 6], dtype=_U8)  # four 2-bit fields
SH_BIT = torch.tensor(range(8), dtype=_U8)  # eight bits

# 4-bit code books (gguf.quants IQ4_NL.kvalues and MXFP4.kvalues: E2M1 values doubled).
KV_IQ4NL = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=_F32
)
KV_MXFP4 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=_F32)

CHUNK_ELEMS = 1 << 18  # weights per chunk: 1 MB of float32 output; intermediates stay in cache


# ----------------------------------------------------------------------------------------- helpers


@functools.cache
def _on(const: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One of this module's constant tables, copied to `device` once (blocks on a GPU dequantize there)."""
    return const.to(device)


def _like(const: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return const if const.device == x.device else _on(const, x.device)


def outer(x: torch.Tensor, shifts: torch.Tensor, mask: int) -> torch.Tensor:
    """Bit fields of bytes, field-major: x [..., L] -> [..., F, L] = (x[..., j] >> shifts[f]) & mask."""
    return torch.bitwise_right_shift(x.unsqueeze(-2), _like(shifts, x).view(-1, 1)).bitwise_and_(mask)


def inner(x: torch.Tensor, shifts: torch.Tensor, mask: int) -> torch.Tensor:
    """Bit fields of bytes, byte-major: x [..., L] -> [..., L, F] = (x[..., j] >> shifts[f]) & mask."""
    return torch.bitwise_right_shift(x.unsqueeze(-1), _like(shifts, x)).bitwise_and_(mask)


def f16_field(blk: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte `offset` of each block, widened to f32: [n, 1]."""
    return blk[:, offset:offset + 2].contiguous().view(torch.float16).to(_F32)


def as_dtype(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Flat bytes reinterpreted as `dtype` without writing to them (copies when misaligned)."""
    flat = data.reshape(-1)
    try:
        return flat.view(dtype)
    except RuntimeError:
        return flat.clone().view(dtype)


def scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 6-bit scales and mins, each [n, 8] uint8.

    Bytes 0-3 hold sc[0:4] (low 6 bits) and the top 2 bits of sc[4:8]; bytes 4-7 likewise for the
    mins; bytes 8-11 hold the low nibbles of sc[4:8] (low half) and of min[4:8] (high half).
    """
    s = s.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=-1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=-1)
    return sc, mn


def _lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for a uint8 index tensor (uint8 would index as a mask, so widen it)."""
    return _like(table, idx)[idx.to(torch.int32)]


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
    torch.mul(d, _lookup(KV_IQ4NL, q), out=out)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2**(e - 128) as f32 (subnormal for e < 2; e = 255 gives 2**127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    return bits.view(_F32)


def _mxfp4(blk: torch.Tensor, out: torch.Tensor) -> None:
    d = e8m0_to_fp32_half(blk[:, 0:1])  # [n, 1]
    q = outer(blk[:, 1:17], SH_NIB, 15).view(-1, 32)  # [n, 32]
    torch.mul(d, _lookup(KV_MXFP4, q), out=out)


def _iq4_xs(blk: torch.Tensor, out: torch.Tensor) -> None:
    n = blk.shape[0]
    d = f16_field(blk, 0)  # [n, 1]
    sl = inner(blk[:, 4:8], SH_NIB, 15).view(n, 8)  # byte i -> scales 2i, 2i+1
    sh = inner(blk[:, 2:4], SH_2BIT, 3).view(n, 8)  # u16 LE, 2 bits per scale
    sc = sl.bitwise_or_(sh.bitwise_left_shift_(4)).sub_(32).view(torch.int8)  # [n, 8]
    dl = (d * sc.to(_F32)).unsqueeze(-1)  # [n, 8, 1]
    q = outer(blk[:, 8:136].reshape(n, 8, 16), SH_NIB, 15).view(n, 8, 32)  # [n, 8, 32]
    torch.mul(dl, _lookup(KV_IQ4NL, q), out=out.view(n, 8, 32))


# --------------------------------------------------------------------------------------- dispatch


FLOAT_DEQUANTIZERS = {QType.F32: _f32, QType.F16: _f16, QType.BF16: _bf16}


@functools.cache
def block_dequantizers() -> dict:
    """qtype -> block function. Built on first use: dequant_kquants imports this module's helpers."""
    from moerun.quant import dequant_kquants as k

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
