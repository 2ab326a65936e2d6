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
from moerun.model.ops import ReferenceOps


def route(ops: ReferenceOps, x: torch.Tensor, lw, spec, raw: bool = False, logits: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights, as spec.router says. x [T, H] -> weights [T, k] (x.dtype),
    ids [T, k]. lw: the layer's weights (router, router_b, score_b). raw: the choice's scores before
    renormalising or scaling (prefetch ranks them).

    softmax       softmax over all experts (fp32), top-k, renormalised when norm_topk (Qwen, Mixtral, OLMoE,
                  DeepSeek-V2), group-limited when n_groups > 1
    topk_softmax  top-k of the logits, softmax over those k (gpt-oss)
    sigmoid       sigmoid scores; the k chosen by score + correction bias within the best topk_groups
                  groups; their scores renormalised when norm_topk (DeepSeek-V3, GLM-4.5)
    then every weight times routed_scale. logits: x @ router.T when the caller has it (without the bias)."""
    k = spec.n_experts_used
    if logits is None:
        logits = ops.linear(x, lw.router, lw.router_b)
    elif lw.router_b is not None:
        logits = logits + lw.router_b
    logits = logits.float()  # [T, E]
    if not raw and (got := ops.route(logits, spec, lw.score_b)) is not None:  # the fused layers' arithmetic
        return got[0].to(x.dtype), got[1]
    if spec.router == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        w = F.softmax(top, dim=-1)
    else:
        scores = F.softmax(logits, dim=-1) if spec.router == "softmax" else torch.sigmoid(logits)  # [T, E]
        choice = scores if lw.score_b is None else scores + lw.score_b.to(scores.device)
        if spec.n_groups > 1:
            choice = _limit_groups(choice, spec)
        ids = torch.topk(choice, k, dim=-1)[1]
        w = scores.gather(1, ids)
        if raw:
            return w.to(x.dtype), ids
        if spec.norm_topk:
            w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if spec.router == "sigmoid" else 0.0))
    if spec.routed_scale != 1.0:
        w = w * spec.routed_scale
    return w.to(x.dtype), ids


def _limit_groups(choice: torch.Tensor, spec) -> torch.Tensor:
    """choice [T, E] with every expert outside each token's best topk_groups groups set to -inf; a group scores
    its best expert ("max") or its best two summed ("top2")."""
    T, E = choice.shape
    groups = choice.view(T, spec.n_groups, E // spec.n_groups)
    score = groups.max(dim=-1).values if spec.group_score == "max" else groups.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, torch.topk(score, spec.topk_groups, dim=-1)[1], True)
    return groups.masked_fill(~keep[..., None], float("-inf")).view(T, E)


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
