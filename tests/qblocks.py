"""Random GGUF weight blocks for kernel tests: random bytes with the float scale fields set to sane values."""

from __future__ import annotations

import torch

from moerun.quant.qtypes import QType, block_size, row_bytes


def random_blocks(qtype: QType, rows: int, cols: int, gen: torch.Generator, kq_scale: float = 1e-3) -> torch.Tensor:
    """uint8 [rows, row bytes] for rows x cols weights. kq_scale: the low end of Q4_K/Q5_K/Q4_1's d and dmin
    (drawn in [kq_scale, 4 kq_scale])."""
    elems, nbytes = block_size(qtype)
    nb = rows * cols // elems
    raw = torch.randint(0, 256, (nb, nbytes), dtype=torch.uint8, generator=gen)

    def f16(offset: int, lo: float, hi: float) -> None:
        v = torch.empty(nb, 1).uniform_(lo, hi, generator=gen)
        raw[:, offset:offset + 2] = v.to(torch.float16).view(torch.uint8)

    if qtype in (QType.Q4_K, QType.Q5_K, QType.Q4_1, QType.Q5_1):
        f16(0, kq_scale, 4 * kq_scale)  # d
        f16(2, kq_scale, 4 * kq_scale)  # dmin
    elif qtype == QType.Q6_K:
        f16(208, 1e-4, 4e-4)
    elif qtype == QType.Q3_K:  # scales in [-32, 31], values in [-4, 3]
        f16(108, 1e-4, 4e-4)
    elif qtype in (QType.Q8_0, QType.Q4_0, QType.Q5_0):
        f16(0, -0.02, 0.02)
    elif qtype == QType.IQ4_NL:  # code book up to 127
        f16(0, -2e-3, 2e-3)
    elif qtype == QType.IQ4_XS:  # sub-block scales up to 31, code book up to 127
        f16(0, -2e-4, 2e-4)
    elif qtype == QType.MXFP4:
        raw[:, 0] = torch.randint(118, 124, (nb,), dtype=torch.uint8, generator=gen)  # 2^-10 .. 2^-5
    return raw.reshape(rows, row_bytes(qtype, cols))


def q5_k_from_q4_k(q4: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Realistic Q5_K bytes (moerun quantizes no Q5_K) from Q4_K blocks ([..., 144 n] uint8): d halved, each 4-bit
    value q becomes 2q + a random bit, so the weights keep their scale and every fifth bit pattern occurs."""
    blocks = q4.reshape(-1, 144)
    nb = blocks.shape[0]
    qs = blocks[:, 16:].reshape(nb, 4, 32).long()
    q = torch.stack([qs & 15, qs >> 4], 2).reshape(nb, 256)  # element 64g + 32h + j
    q5 = 2 * q + torch.randint(0, 2, q.shape, generator=gen)
    out = torch.empty(nb, 176, dtype=torch.uint8)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float() / 2
    out[:, 0:2] = d.to(torch.float16).view(torch.uint8)
    out[:, 2:16] = blocks[:, 2:16]  # dmin, the 12 scale bytes
    fifth = (q5 >> 4).reshape(nb, 8, 32)  # bit k of qh[j] is bit 4 of element 32k + j
    out[:, 16:48] = (fifth << torch.arange(8).view(1, 8, 1)).sum(1).to(torch.uint8)
    low = (q5 & 15).reshape(nb, 4, 2, 32)
    out[:, 48:] = (low[:, :, 0] | low[:, :, 1] << 4).reshape(nb, 128).to(torch.uint8)
    return out.reshape(*q4.shape[:-1], q4.shape[-1] // 144 * 176)
