"""KV blocks handed out to sequences, and shared between them by content (vLLM's automatic prefix caching).

A block filled with block_size tokens can be published under a hash of its tokens and of every token before
them (a chain: block i's hash covers the prefix up to its end, so equal hashes mean equal prefixes and equal
KV). Another sequence whose prompt starts with the same tokens adopts the published blocks instead of
computing them again; a block is freed when no sequence holds it any more, but keeps its hash and its KV
until the allocator hands it out again, least recently used first. A published block is never written again:
a sequence writes only into blocks it holds alone and has not published (SeqKV.truncate gives back a shared
or published block it would write into).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from moerun.errors import MoerunError


class ContextOverflowError(MoerunError):
    """A request needs more positions than the context (or the KV pool) holds."""


def block_hashes(tokens: Sequence[int], block_size: int, n: int | None = None, start: int = 0) -> list[int]:
    """The chained hashes of the first n full blocks of `tokens` (default: every full block); start: the hash
    of the prefix before them (0: none)."""
    full = len(tokens) // block_size if n is None else min(n, len(tokens) // block_size)
    out, h = [], start
    for i in range(full):
        h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class BlockAllocator:
    """Free blocks come from those holding nothing first (the last freed first, so a sequence freed and
    filled again gets consecutive blocks back), then from those holding a published prefix, the least
    recently used first (evicting it)."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._plain = list(range(n_blocks - 1, -1, -1))  # free, no prefix: a stack
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, a published prefix: least recently used first
        self._ref = [0] * n_blocks
        self._hash: dict[int, int] = {}  # block -> its published hash
        self._by_hash: dict[int, int] = {}
        self.queried = self.hit = 0  # prompt blocks looked up, and found (the prefix hit rate)

    @property
    def n_free(self) -> int:
        return len(self._plain) + len(self._cached)

    @property
    def n_cached(self) -> int:
        """Free blocks that still hold a published prefix."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > self.n_free:
            raise ContextOverflowError(f"KV cache full: {n} more blocks needed, {self.n_free} free")
        out = []
        for _ in range(n):
            if self._plain:
                b = self._plain.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash.pop(b)]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash:
                    self._cached[b] = None  # most recently used last
                else:
                    self._plain.append(b)

    def publish(self, block: int, h: int) -> None:
        """Block `block` (held), now full, holds the prefix whose chained hash is h."""
        if block not in self._hash and h not in self._by_hash:
            self._hash[block] = h
            self._by_hash[h] = block

    def unpublish(self, block: int) -> None:
        """Block `block` (held) will be written: it no longer holds its prefix."""
        h = self._hash.pop(block, None)
        if h is not None:
            del self._by_hash[h]

    def published(self, block: int) -> bool:
        return block in self._hash

    def shared(self, block: int) -> bool:
        return self._ref[block] > 1

    def peek(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, are published (nothing changes)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._by_hash:
            n += 1
        return n

    def lookup(self, hashes: list[int]) -> list[int]:
        """The published blocks of the longest run of `hashes` from the first, each now held once more."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
            out.append(b)
        self.queried += len(hashes)
        self.hit += len(out)
        return out
