"""KV cache in fixed-size blocks: one pool per model, a block table per sequence (vLLM's PagedAttention layout).

Pool tensors are [layers, blocks * block_size, kv_heads, head_dim]; a sequence's position p lives in slot
table[p // block_size] * block_size + p % block_size. Blocks are handed out by a BlockAllocator, so
sequences of different lengths share one preallocated pool and freeing a sequence returns its blocks.
"""

from __future__ import annotations

import torch

from moerun.arch.spec import ModelSpec
from moerun.errors import MoerunError


class ContextOverflowError(MoerunError):
    """A request needs more positions than the context (or the KV pool) holds."""


class BlockAllocator:
    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ContextOverflowError(f"KV cache full: {n} more blocks needed, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVPool:
    def __init__(self, spec: ModelSpec, n_tokens: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.block_size = block_size
        n_blocks = -(-n_tokens // block_size)
        shape = (spec.n_layers, n_blocks * block_size, spec.n_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(n_blocks)

    @property
    def usage(self) -> float:
        a = self.allocator
        return 1.0 - a.n_free / a.n_blocks


class SeqKV:
    """One sequence's slice of the pool: its block table and how many positions are filled."""

    def __init__(self, pool: KVPool, max_len: int):
        self.pool, self.max_len = pool, max_len
        self.blocks: list[int] = []
        self.length = 0
        self._slot_index = torch.empty(0, dtype=torch.long)  # pool slot of each reserved position
        self._contiguous = False  # blocks consecutive in the pool: reads are views

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more positions (raises ContextOverflowError past max_len or the pool)."""
        need = self.length + n_new
        if need > self.max_len:
            raise ContextOverflowError(f"{need} tokens exceed the context size of {self.max_len}")
        more = -(-need // self.pool.block_size) - len(self.blocks)
        if more > 0:
            self.blocks += self.pool.allocator.allocate(more)
            bs = self.pool.block_size
            table = torch.tensor(self.blocks, dtype=torch.long)
            pos = torch.arange(len(self.blocks) * bs)
            self._slot_index = (table[pos // bs] * bs + pos % bs).to(self.pool.k.device)
            self._contiguous = self.blocks == list(range(self.blocks[0], self.blocks[0] + len(self.blocks)))

    def truncate(self, length: int) -> None:
        """Forget positions >= length (e.g. to re-prefill from where a new chat prompt diverges)."""
        self.length = min(self.length, length)

    def free(self) -> None:
        self.pool.allocator.free(self.blocks)
        self.blocks, self.length = [], 0
        self._slot_index, self._contiguous = self._slot_index[:0], False

    @property
    def slot_table(self) -> torch.Tensor:
        """int64 [reserved positions]: the pool slot of each position (what fused kernels index with)."""
        return self._slot_index

    def _slots(self, start: int, end: int) -> torch.Tensor:
        return self._slot_index[start:end]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, kv_heads, head_dim] at positions start..start+T (reserved beforehand)."""
        slots = self._slots(start, start + k.shape[0])
        self.pool.k[layer].index_copy_(0, slots, k.to(self.pool.k.dtype))
        self.pool.v[layer].index_copy_(0, slots, v.to(self.pool.v.dtype))

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [end, kv_heads, head_dim] for positions 0..end: a view when the blocks are consecutive in
        the pool (the usual case for a single sequence), else a gather."""
        if end and self._contiguous:
            start = self.blocks[0] * self.pool.block_size
            return self.pool.k[layer, start:start + end], self.pool.v[layer, start:start + end]
        slots = self._slots(0, end)
        return self.pool.k[layer].index_select(0, slots), self.pool.v[layer].index_select(0, slots)
