"""Expert parallelism, the model's side (DESIGN decision 16): each rank computes only the (token, choice) pairs of
the routed experts it owns, and the ranks' partial outputs are summed in rank order.

Every rank runs the dense part on the same hidden states and routes the same way, so the ranks agree on each
token's k experts without a message. A rank numbers its experts 0.. in its own store and cache
(`ExpertStore.shard`, `shard_weights`); a pair whose expert another rank owns gets id -1, which every expert
kernel skips, so a rank never reads, caches or computes another rank's experts.

`ShardedExperts` is a model's expert source under EP (`MoEModel.moe` calls its `run`, as a device stage's
DeviceExperts): each rank of this process computes its partial output [T, H] (`Shard.run`: read where stored,
through the rank's own cache, or on the rank's device through its own DeviceExperts), then, across processes,
`gather` completes the list with the other ranks' parts (an all-gather), and the parts are added in rank order.
Every rank adds the same parts in the same order, so all ranks go on with the same bits and the sum never
depends on timing. The shared expert is added once, after the sum, by the model.

Prefetch (DESIGN decision 6) splits too: the model guesses the next MoE layer's experts by its ids once
(every rank routes alike), and `ShardedExperts.prefetch` hands each rank's cache its own experts of the guess
in its own numbering, so a rank pages in only what it owns and scores the guess against its own fetches. The
guess is made once this process's first rank has fetched the current layer (`run`'s `ahead`), as one cache's.

Whole layers in one C call (`FusedAttention.decode_layers`) cannot stop for the sum: a model whose experts are
not read where they are stored (`MoEModel._direct`) takes the per-layer path, the mixer and routing in C, then
`MoEModel.moe`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from moerun import device
from moerun.experts.cache import ExpertCache
from moerun.experts.store import ExpertStore, expert_rows
from moerun.formats.names import CName
from moerun.hostmem import host_empty
from moerun.model.moe import Experts, ResidentExperts
from moerun.model.ops import PLAIN, ExpertFn, ReferenceOps
from moerun.quant.qtypes import QTensor

EXPERT_TENSORS = tuple(f"ffn_{m}_exps.{t}" for m in ("gate", "up", "down") for t in ("weight", "bias"))


def shard_weights(weights: dict[CName, QTensor], ids: dict[int, list[int]], own: bool) -> None:
    """In place: every routed-expert tensor (matrices and biases) of the layers in `ids` cut to the experts listed
    there (expert_rows); own: copied into memory moerun owns (else views of a file's map stay views)."""
    for cn, t in list(weights.items()):
        if cn.layer in ids and cn.kind in EXPERT_TENSORS:
            part = expert_rows(t, ids[cn.layer])
            if own:
                buf = host_empty(part.nbytes).view(part.data.shape)
                part = QTensor(buf.copy_(part.data), part.qtype, part.shape, part.interleave)
            weights[cn] = part


class Shard:
    """One rank's routed experts, computed in this process.

    ids: MoE layer -> the experts it owns (ascending; the i-th is its expert i). store: those experts
    (ExpertStore.shard); experts: its source over them (read where stored, its own ExpertCache `cache`, or a
    device's DeviceExperts); dev / ops: where and how they are computed. biases: layer -> its experts' rows of
    the layer's expert biases on `dev`, where the model's biases are by the model's ids (a process that loaded
    only its own experts has its biases numbered like them already: none given)."""

    def __init__(self, rank: int, ids: dict[int, list[int]], store: ExpertStore, experts: Experts,
                 cache: ExpertCache | None = None, dev: device.Device = device.CPU, ops: ReferenceOps | None = None,
                 biases: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None):
        self.rank, self.ids, self.store, self.experts, self.cache = rank, ids, store, experts, cache
        self.dev, self.ops, self.biases = dev, ops, biases or {}

    def numbering(self, n_experts: int, layer: int) -> torch.Tensor:
        """[n_experts] int64: this rank's number of each of the layer's experts, -1 where another rank owns it."""
        table = torch.full((n_experts,), -1, dtype=torch.int64)
        table[self.ids[layer]] = torch.arange(len(self.ids[layer]))
        return table

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, phase: str, fn: ExpertFn,
            lead: device.Device, ahead: Callable[[], None] | None = None) -> torch.Tensor:
        """This rank's part of the layer's routed output: x [T, H], ids [T, k] in its own numbering (-1: another
        rank's pair), w [T, k], all on the `lead` device (where the dense part runs) -> [T, H] there. ahead:
        called once this rank has its experts, before it computes (the next layer's prefetch)."""
        if layer in self.biases and fn.biases is not None:
            fn = replace(fn, biases=self.biases[layer])
        away = self.dev != lead
        if away:
            x, ids, w = (device.move(t, self.dev) for t in (x, ids, w))
        with device.use(self.dev):
            if hasattr(self.experts, "run"):  # a device's DeviceExperts (moerun.model.offload)
                out = self.experts.run(layer, x, ids, w, phase, fn)
            else:
                out = self._on_cpu(layer, x, ids, w, phase, fn, ahead)
        return device.move(out, lead) if away else out

    def _on_cpu(self, layer, x, ids, w, phase, fn, ahead=None) -> torch.Tensor:
        stacks = self.store.stacks(layer) if isinstance(self.experts, ResidentExperts) else None
        if stacks is not None and (out := self.ops.moe_stacked(x, ids, w, stacks, fn=fn)) is not None:
            return out
        wanted = sorted(set(ids.reshape(-1).tolist()) - {-1})
        experts = self.experts.fetch(layer, wanted, phase)
        if ahead is not None:
            ahead()  # after this layer's fetch, so the prefetch never competes with its loads
        return self.ops.moe(x, ids, w, experts, fn=fn)


class ShardedExperts:
    """A model's expert source under expert parallelism (module docstring).

    shards: this process's ranks, in rank order; dev: the device the model's dense part runs on; gather(part,
    layer): across processes, this process's one part -> every rank's, in rank order (None: every rank is
    here)."""

    def __init__(self, shards: list[Shard], n_experts: int, dev: device.Device = device.CPU,
                 gather: Callable[[torch.Tensor, int], list[torch.Tensor]] | None = None):
        if [sh.rank for sh in shards] != sorted(sh.rank for sh in shards) or (gather is not None and len(shards) != 1):
            raise ValueError("shards go in rank order, and a process joined to others holds one")
        self.shards, self.n_experts, self.dev, self.gather = shards, n_experts, dev, gather
        self._numbering: dict[tuple[int, int], torch.Tensor] = {}  # (rank, layer) -> Shard.numbering on dev

    @property
    def caches(self) -> list[ExpertCache]:
        return [sh.cache for sh in self.shards if sh.cache is not None]

    @property
    def prefetching(self) -> bool:
        """Whether the model should guess layers ahead: every rank here computes on the CPU behind a cache
        that prefetches (a device rank's DeviceExperts does not)."""
        return all(sh.cache is not None and sh.cache.prefetching and sh.dev.kind == "cpu"
                   for sh in self.shards)

    def prefetch(self, layer: int, guessed: list[int]) -> None:
        """A guess of `layer`'s experts by the model's ids (most likely first) -> each rank's cache pages in
        its own, in its own numbering."""
        for sh in self.shards:
            if sh.cache is not None:
                table = self._number(sh, layer).tolist()
                sh.cache.prefetch(layer, [table[e] for e in guessed if table[e] >= 0])

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, phase: str,
            fn: ExpertFn = PLAIN, ahead: Callable[[], None] | None = None) -> torch.Tensor:
        """x [T, H], ids / w [T, k] (the model's expert ids) -> the routed experts' output [T, H], summed over
        every rank in rank order. ahead: the model's prefetch of the next layer, made once the first rank here
        has its experts."""
        parts = [sh.run(layer, x, self._number(sh, layer)[ids], w, phase, fn, self.dev,
                        ahead if k == 0 else None) for k, sh in enumerate(self.shards)]  # [T, H] each
        if self.gather is not None:
            parts = self.gather(parts[0], layer)
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out

    def _number(self, sh: Shard, layer: int) -> torch.Tensor:
        key = (sh.rank, layer)
        if key not in self._numbering:
            self._numbering[key] = device.upload(sh.numbering(self.n_experts, layer), self.dev)
        return self._numbering[key]
