"""ggml tensor types and their block sizes: what the readers, the planner and the estimator need, without
torch (so `moerun estimate` and `moerun inspect` start fast). QTensor and the torch side: moerun.quant.qtypes."""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

__all__ = ["INTERLEAVABLE", "SUPPORTED", "QType", "bits_per_weight", "block_size", "row_bytes", "tensor_bytes"]

# Types moerun can dequantize (and so load). Others are rejected with a clear error at open time.
SUPPORTED = frozenset(
    {QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
     QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.MXFP4}
)
# qtype -> row groups of the CPU kernels' interleaved layouts
INTERLEAVABLE = {QType.Q4_K: (8,), QType.Q5_K: (8,), QType.Q6_K: (8,), QType.Q8_0: (8,), QType.MXFP4: (8,),
                 QType.IQ4_XS: (8,), QType.Q5_0: (8,), QType.Q5_1: (8,),
                 QType.IQ4_NL: (8,), QType.Q3_K: (8,)}


def block_size(qtype: QType) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return GGML_QUANT_SIZES[qtype]


def bits_per_weight(qtype: QType) -> float:
    n, b = GGML_QUANT_SIZES[qtype]
    return 8.0 * b / n


def row_bytes(qtype: QType, n: int) -> int:
    """Bytes of one row of n elements; raises ValueError when n is not a whole number of blocks."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if n % elems:
        raise ValueError(f"row of {n} elements is not a multiple of {qtype.name}'s block of {elems}")
    return n // elems * nbytes


def tensor_bytes(qtype: QType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of torch shape `shape` (last dimension contiguous)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_bytes(qtype, shape[-1]) if shape else GGML_QUANT_SIZES[qtype][1]
