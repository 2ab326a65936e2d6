"""Bit fields, scale fields and code books of ggml blocks, in vectorized torch: the pieces that every block
dequantizer shares (moerun.quant.dequant's legacy and IQ/MX blocks, moerun.quant.dequant_kquants' K-quants).
Nothing here knows a block type; both modules import it, neither imports the other's helpers back.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["KV_IQ4NL", "KV_MXFP4", "SH_2BIT", "SH_BIT", "SH_NIB", "as_dtype", "f16_field", "inner", "lookup",
           "outer", "scale_min_k4"]

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


def lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for a uint8 index tensor (uint8 would index as a mask, so widen it)."""
    return _like(table, idx)[idx.to(torch.int32)]
