"""KV cache in fixed-size blocks: one pool per model, a block table per sequence (vLLM's PagedAttention layout).

A pool holds the keys and values of a range of layers (all of the model's, or one pipeline rank's), cut into
segments: consecutive layers on one device (a stage's) and one layout (ModelSpec.kv_layout), each [layers,
blocks * block_size, kv_heads, head_dim] (MLA: [layers, slots, kv_lora_rank + qk_rope_dim], no values). Layers
are the model's indices. A sequence's position p lives in slot
table[p // block_size] * block_size + p % block_size of every segment: one block table serves all devices.
Blocks are handed out by a BlockAllocator, so sequences of different lengths share one preallocated pool
and freeing a sequence returns its blocks.
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
    """segments: (first layer, stop layer, torch device) of each consecutive range the pool holds, in order;
    default: every layer of the model on `device`."""

    def __init__(self, spec: ModelSpec, n_tokens: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu",
                 segments: list[tuple[int, int, str | torch.device]] | None = None):
        self.block_size = block_size
        n_blocks = -(-n_tokens // block_size)
        self.n_slots = n_blocks * block_size
        segments = segments or [(0, spec.n_layers, device)]
        if any(b <= a for a, b, _ in segments) or any(s[1] != t[0] for s, t in zip(segments, segments[1:])):
            raise ValueError(f"KV segments must be consecutive non-empty layer ranges, got {segments}")
        self.first, self.stop = segments[0][0], segments[-1][1]
        self.segments = []  # (first, stop, k, v): consecutive layers of one device and one layout, stacked
        for a, b, dev in segments:
            start = a
            for i in range(a + 1, b + 1):  # cut where the layout changes (spec.kv_layout)
                if i == b or spec.kv_layout(i) != spec.kv_layout(start):
                    lay = spec.kv_layout(start)
                    k = torch.zeros((i - start, self.n_slots, *lay.k), dtype=dtype, device=dev)
                    v = torch.zeros((i - start, self.n_slots, *lay.v), dtype=dtype, device=dev) if lay.v else \
                        torch.zeros((i - start, self.n_slots, 0), dtype=dtype, device=dev)
                    self.segments.append((start, i, k, v))
                    start = i
        self.dtype = dtype
        self.allocator = BlockAllocator(n_blocks)

    def range(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [b - a, slots, ...] of layers [a, b), which lie in one segment (one device, one layout): views."""
        for first, stop, k, v in self.segments:
            if first <= a and b <= stop:
                return k[a - first:b - first], v[a - first:b - first]
        raise KeyError(f"layers {a}..{b - 1} are not in one segment of this pool ({self.first}..{self.stop - 1})")

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [slots, kv_heads, head_dim] of layer i."""
        k, v = self.range(i, i + 1)
        return k[0], v[0]

    def device(self, i: int) -> torch.device:
        return self.layer(i)[0].device

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for _, _, k, v in self.segments)

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
        self._slot_index = torch.empty(0, dtype=torch.long)  # pool slot of each reserved position (host)
        self._on: dict[torch.device, torch.Tensor] = {}  # the slot index copied to each device that reads it
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
            self._slot_index = table[pos // bs] * bs + pos % bs
            self._on.clear()
            self._contiguous = self.blocks == list(range(self.blocks[0], self.blocks[0] + len(self.blocks)))

    def truncate(self, length: int) -> None:
        """Forget positions >= length (e.g. to re-prefill from where a new chat prompt diverges)."""
        self.length = min(self.length, length)

    def free(self) -> None:
        self.pool.allocator.free(self.blocks)
        self.blocks, self.length = [], 0
        self._slot_index, self._contiguous = self._slot_index[:0], False
        self._on.clear()

    @property
    def slot_table(self) -> torch.Tensor:
        """int64 [reserved positions] on the host: the pool slot of each position (what fused kernels index with)."""
        return self._slot_index

    def _slots(self, device: torch.device, start: int, end: int) -> torch.Tensor:
        if device.type == "cpu":
            return self._slot_index[start:end]
        if device not in self._on:
            self._on[device] = self._slot_index.to(device)
        return self._on[device][start:end]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Store k/v [T, kv_heads, head_dim] of model layer `layer` at positions start..start+T (reserved); v
        None where the layer's layout keeps none (MLA's latent is k alone)."""
        kc, vc = self.pool.layer(layer)
        slots = self._slots(kc.device, start, start + k.shape[0])
        kc.index_copy_(0, slots, k.to(kc.dtype))
        if v is not None:
            vc.index_copy_(0, slots, v.to(vc.dtype))

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [end, kv_heads, head_dim] for positions 0..end: a view when the blocks are consecutive in
        the pool (the usual case for a single sequence), else a gather."""
        kc, vc = self.pool.layer(layer)
        if end and self._contiguous:
            start = self.blocks[0] * self.pool.block_size
            return kc[start:start + end], vc[start:start + end]
        slots = self._slots(kc.device, 0, end)
        return kc.index_select(0, slots), vc.index_select(0, slots)
