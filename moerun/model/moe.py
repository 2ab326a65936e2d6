"""The MoE block's pieces: the router, and where each step's experts are read from.

`route` picks each token's k experts. An `Experts` source hands over the chosen experts' weights for one
step: `ResidentExperts` reads them where they are stored, `CachedExperts` through an ExpertCache (which may
also prefetch a guess of a layer's experts: `prefetching`, `prefetch`). How they
are multiplied is `ops.moe` (moerun.model.ops); the forward pass knows neither detail.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from moerun.experts.cache import ExpertCache
from moerun.experts.store import Expert, ExpertStore
from moerun.model.ops import ReferenceOps, Weight


def route(ops: ReferenceOps, x: torch.Tensor, router: Weight, k: int, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(fp32) -> top-k (-> renormalise). x [T, H] -> weights [T, k] (x.dtype), ids [T, k]."""
    probs = F.softmax(ops.linear(x, router).float(), dim=-1)  # [T, E]
    w, ids = torch.topk(probs, k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(x.dtype), ids


class Experts(Protocol):
    def fetch(self, layer: int, experts: list[int], phase: str) -> dict[int, Expert]:
        """The weights of `experts` (distinct ids) at `layer` for one step. phase: prefill | decode."""


class ResidentExperts:
    """Every expert read where it is stored (memory map or owned RAM)."""

    def __init__(self, store: ExpertStore):
        self.store = store

    def fetch(self, layer, experts, phase):
        return {e: self.store.get(layer, e) for e in experts}


class CachedExperts:
    """Experts through an ExpertCache: hits from slots, misses paged in or computed at home."""

    def __init__(self, cache: ExpertCache):
        self.cache = cache

    def fetch(self, layer, experts, phase):
        return self.cache.fetch(layer, experts, phase)

    @property
    def prefetching(self) -> bool:
        """Whether the forward pass should guess layers ahead (the cache was built with prefetch on)."""
        return self.cache.prefetching

    def prefetch(self, layer: int, guessed: list[int]) -> None:
        """A guess of `layer`'s experts for the step now running, most likely first: paged in meanwhile."""
        self.cache.prefetch(layer, guessed)
