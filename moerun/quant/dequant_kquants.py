"""K-quant block dequantizers (super-blocks of 256 weights), bit-exact against gguf.quants.

Same contract as the functions in dequant.py (which imports this module; both take their bit helpers
from bitfields.py): `fn(blk [n, block_bytes] uint8, out [n, 256] float32)`.
Byte layouts (offsets within a block) are given in each docstring.
"""

from __future__ import annotations

import torch

from moerun.quant.bitfields import SH_2BIT, SH_BIT, SH_NIB, f16_field, outer, scale_min_k4

__all__ = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]

_F32 = torch.float32


def q2_k(blk: torch.Tensor, out: torch.Tensor) -> None:
    """scales[0:16] (low nibble scale, high nibble min) | qs[16:80] 2-bit | d[80:82] | dmin[82:84]."""
    n = blk.shape[0]
    sc = blk[:, 0:16]
    d, dmin = f16_field(blk, 80), f16_field(blk, 82)  # [n, 1]
    dl = (d * (sc & 15).to(_F32)).unsqueeze(-1)  # [n, 16, 1]
    ml = (dmin * (sc >> 4).to(_F32)).unsqueeze(-1)  # [n, 16, 1]
    q = outer(blk[:, 16:80].reshape(n, 2, 32), SH_2BIT, 3).view(n, 16, 16)  # [n, 2, 4, 32] -> [n, 16, 16]
    torch.sub(q.to(_F32).mul_(dl), ml, out=out.view(n, 16, 16))


def q3_k(blk: torch.Tensor, out: torch.Tensor) -> None:
    """hmask[0:32] | qs[32:96] 2-bit | scales[96:108] 16 x 6-bit | d[108:110]. q = low2 - 4 * !hbit."""
    n = blk.shape[0]
    d = f16_field(blk, 108)  # [n, 1]
    lo = outer(blk[:, 96:104], SH_NIB, 15).view(n, 16)  # [n, 2, 8]: nibble s of byte i -> scale 8s + i
    hi = outer(blk[:, 104:108], SH_2BIT, 3).view(n, 16)  # [n, 4, 4]: bits 2k of byte 8+i -> scale 4k + i
    sc = lo.bitwise_or_(hi.bitwise_left_shift_(4)).sub_(32).view(torch.int8)  # [n, 16]
    dl = (d * sc.to(_F32)).unsqueeze(-1)  # [n, 16, 1]
    ql = outer(blk[:, 32:96].reshape(n, 2, 32), SH_2BIT, 3).view(n, 16, 16)  # [n, 2, 4, 32]
    qh = outer(blk[:, 0:32], SH_BIT, 1).view(n, 16, 16)  # [n, 8, 32]: bit k of byte j -> weight 32k + j
    q = ql.bitwise_or_(qh.bitwise_left_shift_(2)).sub_(4).view(torch.int8)  # low2 + 4*hbit - 4, in [-4, 3]
    torch.mul(dl, q.to(_F32), out=out.view(n, 16, 16))


def q4_k(blk: torch.Tensor, out: torch.Tensor) -> None:
    """d[0:2] | dmin[2:4] | scales[4:16] 8 x (6-bit scale, 6-bit min) | qs[16:144] nibbles."""
    n = blk.shape[0]
    d, dmin = f16_field(blk, 0), f16_field(blk, 2)  # [n, 1]
    sc, mn = scale_min_k4(blk[:, 4:16])  # [n, 8]
    dl = (d * sc.to(_F32)).unsqueeze(-1)  # [n, 8, 1]
    ml = (dmin * mn.to(_F32)).unsqueeze(-1)  # [n, 8, 1]
    q = outer(blk[:, 16:144].reshape(n, 4, 32), SH_NIB, 15).view(n, 8, 32)  # [n, 4, 2, 32] -> [n, 8, 32]
    torch.sub(q.to(_F32).mul_(dl), ml, out=out.view(n, 8, 32))


def q5_k(blk: torch.Tensor, out: torch.Tensor) -> None:
    """d[0:2] | dmin[2:4] | scales[4:16] | qh[16:48] (bit k of byte j -> weight 32k + j) | qs[48:176]."""
    n = blk.shape[0]
    d, dmin = f16_field(blk, 0), f16_field(blk, 2)  # [n, 1]
    sc, mn = scale_min_k4(blk[:, 4:16])  # [n, 8]
    dl = (d * sc.to(_F32)).unsqueeze(-1)  # [n, 8, 1]
    ml = (dmin * mn.to(_F32)).unsqueeze(-1)  # [n, 8, 1]
    ql = outer(blk[:, 48:176].reshape(n, 4, 32), SH_NIB, 15).view(n, 8, 32)  # [n, 4, 2, 32]
    qh = outer(blk[:, 16:48], SH_BIT, 1)  # [n, 8, 32]
    q = ql.bitwise_or_(qh.bitwise_left_shift_(4))
    torch.sub(q.to(_F32).mul_(dl), ml, out=out.view(n, 8, 32))


def q6_k(blk: torch.Tensor, out: torch.Tensor) -> None:
    """ql[0:128] low nibbles | qh[128:192] high 2 bits | scales[192:208] int8 per 16 | d[208:210]. q - 32."""
    n = blk.shape[0]
    d = f16_field(blk, 208)  # [n, 1]
    dl = (d * blk[:, 192:208].contiguous().view(torch.int8).to(_F32)).unsqueeze(-1)  # [n, 16, 1]
    # byte j of half h: low nibble -> weight 128h + j, high nibble -> 128h + 64 + j
    ql = outer(blk[:, 0:128].reshape(n, 2, 64), SH_NIB, 15)  # [n, 2, 2, 64]
    # byte j of half h: bits 2k -> weight 128h + 32k + j
    qh = outer(blk[:, 128:192].reshape(n, 2, 32), SH_2BIT, 3)  # [n, 2, 4, 32]
    q = ql.view(n, 16, 16).bitwise_or_(qh.view(n, 16, 16).bitwise_left_shift_(4)).sub_(32).view(torch.int8)
    torch.mul(dl, q.to(_F32), out=out.view(n, 16, 16))
