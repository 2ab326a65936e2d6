"""KV cache types (llama.cpp's -ctk / -ctv): how a layer's keys and values are stored per position.

f32, f16 and bf16 store floats. q8_0 and q4_0 store each position's row (kv_heads x head_dim values, or MLA's
latent) in ggml's blocks of 32 values, as llama.cpp's quantized caches do: q8_0 an f16 scale and 32 int8 (34
bytes), q4_0 an f16 scale and 32 four-bit values (18 bytes); quantized when written, dequantized when read
(moerun.quant, bit-exact with gguf.quants). Reads return the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moerun.quant.dequant import dequantize
from moerun.quant.ggml_types import QType, block_size
from moerun.quant.quantize import quantize


@dataclass(frozen=True)
class KVType:
    name: str
    dtype: torch.dtype | None = None  # float storage
    qtype: QType | None = None  # block storage

    @property
    def bytes_per_value(self) -> float:
        if self.dtype is not None:
            return torch.finfo(self.dtype).bits / 8
        elems, nbytes = block_size(self.qtype)
        return nbytes / elems

    def check(self, shape: tuple[int, ...], what: str) -> None:
        """A row of `shape` can be stored (a block type needs rows of whole blocks) -> else ValueError."""
        if self.qtype is not None and shape:
            elems = block_size(self.qtype)[0]
            if math.prod(shape) % elems:
                raise ValueError(f"KV cache type {self.name} stores rows in blocks of {elems} values, but {what} "
                                 f"has rows of {math.prod(shape)}; use f16 or f32")

    def storage(self, shape: tuple[int, ...], compute: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
        """A position's stored shape and dtype for logical rows of `shape`."""
        if self.qtype is None:
            return shape, self.dtype or compute
        if not shape:
            return (0,), torch.uint8
        elems, nbytes = block_size(self.qtype)
        return (math.prod(shape) // elems * nbytes,), torch.uint8

    def encode(self, x: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
        """x [T, *shape] -> what the cache stores for those T positions."""
        if self.qtype is None:
            return x.to(stored)
        return quantize(x.reshape(x.shape[0], -1).float(), self.qtype)

    def decode(self, data: torch.Tensor, shape: tuple[int, ...], compute: torch.dtype) -> torch.Tensor:
        """Stored rows [n, ...] -> [n, *shape] in the compute dtype (a view when nothing needs converting)."""
        if self.qtype is None:
            return data if data.dtype == compute else data.to(compute)
        n = data.shape[0]
        return dequantize(data.contiguous(), self.qtype, (n, math.prod(shape))).view(n, *shape).to(compute)


KV_TYPES = {
    "f32": KVType("f32", torch.float32),
    "f16": KVType("f16", torch.float16),
    "bf16": KVType("bf16", torch.bfloat16),
    "q8_0": KVType("q8_0", qtype=QType.Q8_0),
    "q4_0": KVType("q4_0", qtype=QType.Q4_0),
}


def kv_type(name: str | None, compute: torch.dtype) -> KVType:
    """A KV cache type by llama.cpp's name; None: the compute dtype's (what moerun stores by default: the fused
    C decode path reads float32 keys and values)."""
    if name is None:
        return next(t for t in KV_TYPES.values() if t.dtype == compute)
    if name not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {name!r}: choose one of {', '.join(KV_TYPES)}")
    return KV_TYPES[name]
