"""KV cache in fixed-size blocks: one pool per model, a block table per sequence (vLLM's PagedAttention layout).

A pool holds the keys and values of a range of layers (all of the model's, or one pipeline rank's), cut into
segments: consecutive layers on one device (a stage's) and one layout (ModelSpec.kv_layout), each [layers,
blocks * block_size, kv_heads, head_dim] (MLA: [layers, slots, kv_lora_rank + qk_rope_dim], no values). Layers
are the model's indices. A sequence's position p lives in slot
table[p // block_size] * block_size + p % block_size of every segment: one block table serves all devices.
Blocks are handed out by a BlockAllocator, so sequences of different lengths share one preallocated pool
and freeing a sequence returns its blocks.

A sliding-window layer (gpt-oss) keeps only its window: its segment holds one ring of blocks per sequence the
pool serves at once (`seqs`), position p in block (p // block_size) % n of the sequence's ring (n from
KVLayout.ring_blocks), so its memory does not grow with the context. A step attends to a ring layer's window
as it was before the step (`read` before `write`); the fused C path writes at most RING_ROWS positions of a
sequence before attending, which the ring leaves room for. `windows=False` keeps every position of such layers
too (the window is then only a mask).

A linear-attention layer (Qwen3-Next's gated DeltaNet) keeps no KV: a sequence holds a fixed-size state there
(`state(i)`: the conv window [slots, C, K-1] and the delta rule's matrices [slots, nv, dk, dv], float32 on the
segment's device), one live slot per sequence the pool serves at once plus `checkpoints` snapshots of it. A
recurrent state cannot be cut back to an earlier position, so a sequence's prefix is reusable only up to its
live length or a checkpoint: the engine takes one where a prompt ends (before its last token), and `truncate`
goes back to the latest checkpoint at or before the length asked for (0 if there is none).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import torch

from moerun import device as _device
from moerun.arch.spec import ModelSpec
from moerun.engine.blocks import BlockAllocator, ContextOverflowError, block_hashes
from moerun.engine.kv_types import kv_type
from moerun.hostmem import host_zeros

__all__ = ["BlockAllocator", "ContextOverflowError", "KVPool", "SeqKV"]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype | None, dev) -> torch.Tensor:
    """torch.zeros; on the CPU a mapping whose pages are zeroed when first written (the positions a run never reaches
    are never touched)."""
    dtype = dtype or torch.get_default_dtype()
    return host_zeros(shape, dtype) if torch.device(dev).type == "cpu" else torch.zeros(shape, dtype=dtype, device=dev)


class KVPool:
    """segments: (first layer, stop layer, torch device) of each consecutive range the pool holds, in order;
    default: every layer of the model on `device`. seqs: sequences holding blocks at once, for the rings of
    sliding-window layers (module docstring); windows=False: those layers keep every position. kv_types: the
    keys' and the values' storage (moerun.engine.kv_types; None: `dtype`, the compute dtype reads return)."""

    def __init__(self, spec: ModelSpec, n_tokens: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu",
                 segments: list[tuple[int, int, str | torch.device]] | None = None, seqs: int = 1,
                 windows: bool = True, checkpoints: int = 1, share: bool = True,
                 kv_types: tuple[str | None, str | None] = (None, None)):
        self.block_size = block_size
        self.k_type, self.v_type = (kv_type(t, dtype) for t in kv_types)
        self.shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # layer -> its k and v rows' shapes
        n_blocks = -(-n_tokens // block_size)
        self.n_slots = n_blocks * block_size
        segments = segments or [(0, spec.n_layers, device)]
        if any(b <= a for a, b, _ in segments) or any(s[1] != t[0] for s, t in pairwise(segments)):
            raise ValueError(f"KV segments must be consecutive non-empty layer ranges, got {segments}")
        if seqs < 1:
            raise ValueError(f"seqs must be at least 1, got {seqs}")
        self.first, self.stop = segments[0][0], segments[-1][1]

        def layout(i: int):
            lay = spec.kv_layout(i)
            return lay if windows or lay is None else replace(lay, window=0)

        lays = [lay for lay in map(layout, range(self.first, self.stop)) if lay is not None]
        rings = {lay.ring_blocks(block_size) for lay in lays if lay.window}
        self.ring = max(rings, default=0)  # blocks of one sequence's ring (0: no windowed layer here)
        self.window = max((lay.window for lay in lays), default=0)
        self.seqs = seqs
        self._free_rings = list(range(seqs - 1, -1, -1)) if self.ring else []
        self.windowed: set[int] = set()  # layers whose cache is a ring per sequence
        self.segments = []  # (first, stop, k, v): consecutive layers of one device and one layout, stacked
        self._caches: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}  # caches(a, b)
        # linear layers' states: slot group g (one per sequence) is slots g * per_seq (live) .. + checkpoints
        self.checkpoints = max(0, checkpoints)
        self.per_seq = 1 + self.checkpoints
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for a, b, dev in segments:
            for i in range(a, b):
                st = spec.state_layout(i)
                if st is not None:
                    n = seqs * self.per_seq
                    self.states[i] = (_zeros((n, *st.conv), None, dev), _zeros((n, *st.ssm), None, dev))
        self._free_states = list(range(seqs - 1, -1, -1)) if self.states else []
        for a, b, dev in segments:
            start = a
            for i in range(a + 1, b + 1):  # cut where the layout changes (spec.kv_layout)
                if i == b or layout(i) != layout(start):
                    lay = layout(start)
                    if lay is None:  # linear layers: their states above
                        start = i
                        continue
                    slots = self.n_slots if not lay.window else seqs * self.ring * block_size
                    if lay.window:
                        self.windowed |= set(range(start, i))
                    self.k_type.check(lay.k, f"layer {start}'s keys")
                    self.v_type.check(lay.v, f"layer {start}'s values")
                    if (self.k_type.qtype or self.v_type.qtype) and torch.device(dev).type != "cpu":
                        raise ValueError("quantized KV cache types (q8_0, q4_0) are for KV on the CPU; a GPU "
                                         "stage's cache takes f32, f16 or bf16")
                    kshape, kdt = self.k_type.storage(lay.k, dtype)
                    vshape, vdt = self.v_type.storage(lay.v, dtype) if lay.v else ((0,), dtype)
                    k = _zeros((i - start, slots, *kshape), kdt, dev)
                    v = _zeros((i - start, slots, *vshape), vdt, dev)
                    self.shapes |= {j: (lay.k, lay.v) for j in range(start, i)}
                    self.segments.append((start, i, k, v))
                    start = i
        self.dtype = dtype
        # keys and values stored as the compute dtype: reads are views, and the fused C path can use the pool
        self.plain = self.k_type.dtype == dtype and self.v_type.dtype == dtype
        self.allocator = BlockAllocator(n_blocks)
        # prefix blocks shared between sequences (moerun.engine.blocks): not with per-sequence rings or states,
        # which a block of another sequence's prefix does not bring along
        self.share = share and not self.ring and not self.states

    def take_ring(self) -> int:
        if not self._free_rings:
            raise ContextOverflowError(f"KV cache full: its sliding-window layers hold {self.seqs} sequence(s) at "
                                       "once, all in use")
        return self._free_rings.pop()

    def give_ring(self, r: int) -> None:
        self._free_rings.append(r)

    @property
    def recurrent(self) -> bool:
        """Some layers here keep a recurrent state (linear attention)."""
        return bool(self.states)

    def take_state(self) -> int:
        if not self._free_states:
            raise ContextOverflowError(f"KV cache full: its linear-attention layers hold {self.seqs} sequence(s) "
                                       "at once, all in use")
        return self._free_states.pop()

    def give_state(self, g: int) -> None:
        self._free_states.append(g)

    def state(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer i's conv windows [slots, C, K-1] and delta-rule matrices [slots, nv, dk, dv]."""
        return self.states[i]

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's KV of block src into block dst."""
        bs = self.block_size
        for _, _, k, v in self.segments:
            k[:, dst * bs:(dst + 1) * bs] = k[:, src * bs:(src + 1) * bs]
            v[:, dst * bs:(dst + 1) * bs] = v[:, src * bs:(src + 1) * bs]

    def copy_state(self, src: int, dst: int) -> None:
        """Every linear layer's state slot src into slot dst."""
        for conv, ssm in self.states.values():
            conv[dst] = conv[src]
            ssm[dst] = ssm[src]

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

    def caches(self, a: int, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each of layers [a, b)'s k, v (views), or a linear layer's conv and ssm states: the same list every call, so
        a decode step's fused kernels bind it once (moerun.model.fused)."""
        got = self._caches.get((a, b))
        if got is None:
            got = self._caches[a, b] = [self.states[i] if i in self.states else self.layer(i) for i in range(a, b)]
        return got

    def device(self, i: int) -> torch.device:
        if i in self.states:
            return self.states[i][0].device
        for first, stop, k, _ in self.segments:
            if first <= i < stop:
                return k.device
        raise KeyError(f"layer {i} is not in this pool ({self.first}..{self.stop - 1})")

    @property
    def nbytes(self) -> int:
        return (sum(k.nbytes + v.nbytes for _, _, k, v in self.segments)
                + sum(c.nbytes + m.nbytes for c, m in self.states.values()))

    @property
    def usage(self) -> float:
        a = self.allocator
        return 1.0 - a.n_free / a.n_blocks


class SeqKV:
    """One sequence's slice of the pool: its block table (and its ring in windowed layers) and how many
    positions are filled."""

    def __init__(self, pool: KVPool, max_len: int):
        self.pool, self.max_len = pool, max_len
        self.blocks: list[int] = []
        self.length = 0
        self._ring: int | None = None  # which ring of the windowed layers is this sequence's
        self._slot_index = torch.empty(0, dtype=torch.long)  # pool slot of each reserved position (host)
        self._ring_index = self._slot_index  # windowed layers' slot of each reserved position (host)
        self._on: dict[tuple[torch.device, bool], torch.Tensor] = {}  # the indexes copied to devices that read them
        self._contiguous = False  # blocks consecutive in the pool: reads are views
        self._state: int | None = None  # which slot group of the linear layers' states is this sequence's
        self._checkpoints: dict[int, int] = {}  # checkpoint slot -> the length its state was taken at
        self._hashes: list[int] = []  # chained hashes of the full blocks this sequence published or adopted

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more positions (raises ContextOverflowError past max_len or the pool)."""
        need = self.length + n_new
        if need > self.max_len:
            raise ContextOverflowError(f"{need} tokens exceed the context size of {self.max_len}")
        if self._state is None and self.pool.recurrent:
            self._state = self.pool.take_state()
        more = -(-need // self.pool.block_size) - len(self.blocks)
        if more > 0:
            if self._ring is None and self.pool.ring:
                self._ring = self.pool.take_ring()
            self.blocks += self.pool.allocator.allocate(more)
            self._reindex()

    def _reindex(self) -> None:
        bs, n = self.pool.block_size, self.pool.ring
        table = torch.tensor(self.blocks, dtype=torch.long)
        pos = torch.arange(len(self.blocks) * bs)
        self._slot_index = table[pos // bs] * bs + pos % bs
        self._ring_index = (self._ring * n + (pos // bs) % n) * bs + pos % bs if n else self._slot_index
        self._on.clear()
        self._contiguous = bool(self.blocks) and \
            self.blocks == list(range(self.blocks[0], self.blocks[0] + len(self.blocks)))

    def publish(self, tokens: list[int]) -> None:
        """Offer this sequence's full blocks to others by content (`tokens`: the ids at positions 0..length)."""
        if not self.pool.share:
            return
        bs, alloc = self.pool.block_size, self.pool.allocator
        full = min(len(tokens), self.length) // bs
        if full > len(self._hashes):
            h = self._hashes[-1] if self._hashes else 0
            for i in range(len(self._hashes), full):
                h = block_hashes(tokens[i * bs:(i + 1) * bs], bs, None, start=h)[0]
                self._hashes.append(h)
                alloc.publish(self.blocks[i], h)

    def adopt(self, prompt: list[int]) -> bool:
        """Take the published blocks of the longest prefix of `prompt` (all but its last token) when they cover
        more than this sequence holds -> whether it did (its own blocks given back first)."""
        if not self.pool.share:
            return False
        bs, alloc = self.pool.block_size, self.pool.allocator
        hashes = block_hashes(prompt, bs, (len(prompt) - 1) // bs)
        if alloc.peek(hashes) * bs <= self.length:
            alloc.queried += len(hashes)
            alloc.hit += min(len(hashes), self.length // bs)
            return False
        found = alloc.lookup(hashes)  # held once more before ours go, so a block of ours found stays held
        alloc.free(self.blocks)
        self.blocks, self.length, self._hashes = found, len(found) * bs, hashes[:len(found)]
        self._reindex()
        return True

    def truncate(self, length: int) -> None:
        """Forget positions >= length (e.g. to re-prefill from where a new chat prompt diverges). Where the
        windowed layers' rings no longer hold the window before `length`, everything is forgotten (length 0)."""
        old, length = self.length, min(self.length, length)
        if self.pool.ring and length < old:
            bs = self.pool.block_size
            held_from = max(0, ((old - 1) // bs - self.pool.ring + 1) * bs)  # the rings' oldest position
            if max(0, length - self.pool.window + 1) < held_from:
                length = 0
        if self.pool.recurrent and length < old:  # back to the latest checkpoint at or before length
            slot, at = max(((s, p) for s, p in self._checkpoints.items() if p <= length), key=lambda sp: sp[1],
                           default=(None, 0))
            if slot is not None:
                self.pool.copy_state(slot, self.state_slot)
            length = at
            self._checkpoints = {s: p for s, p in self._checkpoints.items() if p <= length}
        if self.pool.share:
            length = self._release_from(length)
        self.length = length

    def _release_from(self, length: int) -> int:
        """Give back the blocks past `length`; the block it ends in, which will be written into, stops holding a
        published prefix (copied first when another sequence holds it too) -> the length kept."""
        bs, alloc = self.pool.block_size, self.pool.allocator
        keep = -(-length // bs)
        if keep < len(self.blocks):
            alloc.free(self.blocks[keep:])
            self.blocks = self.blocks[:keep]
            self._reindex()
        last = self.blocks[keep - 1] if length % bs else None
        if last is not None and alloc.shared(last):  # copy on write
            fresh = alloc.allocate(1)[0]
            self.pool.copy_block(last, fresh)
            alloc.free([last])
            self.blocks[keep - 1] = fresh
            self._reindex()
        elif last is not None:
            alloc.unpublish(last)
        self._hashes = self._hashes[:length // bs]
        return length

    def hold_state(self, slot: int) -> None:
        """Keep the linear layers' state in live slot `slot`, which another pool handed out (a worker rank repeats
        rank 0's steps), rather than take one from this pool."""
        self._state = slot // self.pool.per_seq

    @property
    def state_slot(self) -> int:
        """The linear layers' live state slot of this sequence (reserve() takes one)."""
        return self._state * self.pool.per_seq

    def checkpoint(self) -> None:
        """Keep a copy of the linear layers' state at the current length (truncate can come back to it); the
        oldest checkpoint gives way when all are taken. Nothing without linear layers or checkpoints."""
        if not self.pool.recurrent or not self.pool.checkpoints or self._state is None:
            return
        if self.length in self._checkpoints.values():
            return
        free = [self.state_slot + 1 + c for c in range(self.pool.checkpoints)
                if self.state_slot + 1 + c not in self._checkpoints]
        slot = free[0] if free else min(self._checkpoints, key=self._checkpoints.get)
        self.pool.copy_state(self.state_slot, slot)
        self._checkpoints[slot] = self.length

    @property
    def checkpoint_lengths(self) -> list[int]:
        return sorted(self._checkpoints.values())

    def free(self) -> None:
        self.pool.allocator.free(self.blocks)
        if self._ring is not None:
            self.pool.give_ring(self._ring)
        if self._state is not None:
            self.pool.give_state(self._state)
        self.blocks, self.length, self._ring, self._state, self._checkpoints = [], 0, None, None, {}
        self._hashes = []
        self._slot_index, self._contiguous = self._slot_index[:0], False
        self._ring_index = self._slot_index
        self._on.clear()

    @property
    def slot_table(self) -> torch.Tensor:
        """int64 [reserved positions] on the host: the pool slot of each position (what fused kernels index with)."""
        return self._slot_index

    @property
    def ring_table(self) -> torch.Tensor:
        """int64 [reserved positions] on the host: each position's slot in the windowed layers' rings."""
        return self._ring_index

    def _slots(self, device: torch.device, start: int, end: int, ring: bool = False) -> torch.Tensor:
        index = self._ring_index if ring else self._slot_index
        if device.type == "cpu":
            return index[start:end]
        if (device, ring) not in self._on:  # through pinned memory: a pageable upload would wait for the device
            self._on[device, ring] = _device.upload(index, device)
        return self._on[device, ring][start:end]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Store k/v [T, kv_heads, head_dim] of model layer `layer` at positions start..start+T (reserved); v
        None where the layer's layout keeps none (MLA's latent is k alone); a windowed layer keeps the last of
        them its ring holds."""
        kc, vc = self.pool.layer(layer)
        ring = layer in self.pool.windowed
        end = start + k.shape[0]
        if ring and k.shape[0] > self.pool.ring * self.pool.block_size:
            cut = k.shape[0] - self.pool.ring * self.pool.block_size
            k, v, start = k[cut:], None if v is None else v[cut:], start + cut
        slots = self._slots(kc.device, start, end, ring)
        pool = self.pool
        kc.index_copy_(0, slots, pool.k_type.encode(k, kc.dtype))
        if v is not None:
            vc.index_copy_(0, slots, pool.v_type.encode(v, vc.dtype))

    def read(self, layer: int, end: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [end - start, kv_heads, head_dim] for positions start..end: a view when the blocks are
        consecutive in the pool (the usual case for a single sequence), else a gather. A windowed layer's ring
        holds the positions of the last window only."""
        pool = self.pool
        kc, vc = pool.layer(layer)
        ring = layer in pool.windowed
        if end > start and self._contiguous and not ring:
            first = self.blocks[0] * pool.block_size
            k, v = kc[first + start:first + end], vc[first + start:first + end]
        else:
            slots = self._slots(kc.device, start, end, ring)
            k, v = kc.index_select(0, slots), vc.index_select(0, slots)
        if pool.plain:
            return k, v
        ks, vs = pool.shapes[layer]
        return pool.k_type.decode(k, ks, pool.dtype), pool.v_type.decode(v, vs, pool.dtype) if vs else v
