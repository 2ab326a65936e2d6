"""The MoE block: router -> top-k -> experts -> combine (+ shared expert).

Experts are computed through one object with the `Experts` interface: `ResidentExperts` reads every expert
from the home-tier store, `CachedExperts` goes through an ExpertCache. The forward pass doesn't know which.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from moerun.experts.cache import ExpertCache
from moerun.experts.store import Expert, ExpertStore
from moerun.model.layers import Weight, linear, swiglu


def route(x: torch.Tensor, router: Weight, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(fp32) -> top-k (-> renormalise). x [T, H] -> weights [T, k] (x.dtype), ids [T, k]."""
    probs = F.softmax(linear(x, router).float(), dim=-1)  # [T, E]
    w, ids = torch.topk(probs, k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(x.dtype), ids


def combine(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[int, Expert]) -> torch.Tensor:
    """sum over each token's k choices of w * expert(x). x [T, H], ids/w [T, k] -> [T, H].

    Experts run in ascending id order, so the result does not depend on where their weights live.
    """
    out = torch.zeros_like(x)
    for e in sorted(experts):
        tok, slot = torch.where(ids == e)  # tokens routed to e, and which of their k choices it was
        ex = experts[e]
        y = swiglu(x[tok], ex.gate, ex.up, ex.down)
        out.index_add_(0, tok, y * w[tok, slot, None])
    return out


class Experts(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, phase: str
                 ) -> torch.Tensor:
        """x [T, H], ids/w [T, k] -> sum over k of w * expert_ids(x), [T, H]. phase: prefill | decode."""


class ResidentExperts:
    """Every expert read where it is stored (memory map or owned RAM)."""

    def __init__(self, store: ExpertStore):
        self.store = store

    def __call__(self, layer, x, ids, w, phase):
        return combine(x, ids, w, {e: self.store.get(layer, e) for e in torch.unique(ids).tolist()})


class CachedExperts:
    """Experts through an ExpertCache: hits from slots, misses paged in or computed at home."""

    def __init__(self, cache: ExpertCache):
        self.cache = cache

    def __call__(self, layer, x, ids, w, phase):
        return combine(x, ids, w, self.cache.fetch(layer, torch.unique(ids).tolist(), phase))
