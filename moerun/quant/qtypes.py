"""Quantization types: block geometry and byte sizes, and QTensor (raw blocks + qtype + logical shape)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moerun.quant.ggml_types import (
    INTERLEAVABLE,
    SUPPORTED,
    QType,
    bits_per_weight,
    block_size,
    row_bytes,
    tensor_bytes,
)

__all__ = ["FLOAT_QTYPES", "INTERLEAVABLE", "SUPPORTED", "QTensor", "QType", "bits_per_weight", "block_size",
           "row_bytes", "tensor_bytes"]

FLOAT_QTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}

# An interleaved QTensor -> its GGUF-layout copy. Set by moerun.kernels.cpu when it is imported: only it makes
# interleaved tensors (quant sits below the kernels, so it cannot import them).
_deinterleave: Callable[[QTensor], QTensor] | None = None


def set_deinterleave(fn: Callable[[QTensor], QTensor]) -> None:
    """How QTensor.dequantize undoes the CPU kernels' interleaved layouts (moerun.kernels.cpu.deinterleave)."""
    global _deinterleave
    _deinterleave = fn


@dataclass(frozen=True)
class QTensor:
    """A tensor held as stored: raw bytes `data` (uint8, [*shape[:-1], row_bytes]) of type `qtype`.

    `shape` is the logical torch shape (last dimension contiguous). Float types are QTensors too,
    so every weight has one representation; `dequantize()` is the torch reference.

    interleave: 1 for the bytes as GGUF stores them; 8 for the CPU kernels' interleaved layout (rows in
    groups of 8, same bytes per group; made at load time by moerun.kernels.cpu.interleave;
    Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS, Q5_0, Q5_1, IQ4_NL).
    An interleaved matrix's rows cannot be sliced out; its experts (outer dimensions) can.
    """

    data: torch.Tensor
    qtype: QType
    shape: tuple[int, ...]
    interleave: int = 1

    def __post_init__(self):
        if self.data.dtype != torch.uint8:
            raise TypeError("QTensor.data must be uint8")
        want = (*self.shape[:-1], row_bytes(self.qtype, self.shape[-1]))
        if tuple(self.data.shape) != want:
            raise ValueError(f"QTensor data shape {tuple(self.data.shape)} != {want} for {self.qtype.name}{self.shape}")
        if self.interleave != 1 and not (self.interleave in INTERLEAVABLE.get(self.qtype, ()) and
                                         len(self.shape) >= 2 and self.shape[-2] % self.interleave == 0):
            raise ValueError(f"{self.qtype.name}{self.shape} cannot be interleaved by {self.interleave}")

    @classmethod
    def from_bytes(cls, raw: torch.Tensor, qtype: QType, shape: tuple[int, ...], interleave: int = 1) -> QTensor:
        shape = tuple(int(s) for s in shape)
        return cls(raw.reshape(*shape[:-1], row_bytes(qtype, shape[-1])), qtype, shape, interleave)

    @classmethod
    def from_float(cls, t: torch.Tensor) -> QTensor:
        """Wrap a float32/float16/bfloat16 tensor without copying it (when contiguous)."""
        qtype = {v: k for k, v in FLOAT_QTYPES.items()}[t.dtype]
        t = t.contiguous()
        return cls(t.view(torch.uint8).reshape(*t.shape[:-1], -1), qtype, tuple(t.shape))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __getitem__(self, i: int) -> QTensor:
        """Slice along the outermost dimension (expert e of a stacked [E, rows, cols] tensor): a view."""
        if self.interleave != 1 and len(self.shape) < 3:
            raise ValueError("the rows of an interleaved matrix cannot be sliced out")
        return QTensor(self.data[i], self.qtype, self.shape[1:], self.interleave)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from moerun.quant.dequant import dequantize

        data = self.data
        if self.interleave != 1:  # only made by the CPU kernels, which set _deinterleave when imported
            if _deinterleave is None:
                raise RuntimeError("interleaved QTensors are read back by moerun.kernels.cpu: not imported")
            data = _deinterleave(self).data
        return dequantize(data, self.qtype, self.shape).to(dtype)
