"""The MoE block: router -> top-k -> experts -> combine (+ shared expert).

Experts are computed through one object with the `Experts` interface, so the expert cache (issue 5)
can replace `ResidentExperts` without touching the forward pass.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from moerun.model.layers import Weight, linear, swiglu
from moerun.quant.qtypes import QTensor


def route(x: torch.Tensor, router: Weight, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(fp32) -> top-k (-> renormalise). x [T, H] -> weights [T, k] (x.dtype), ids [T, k]."""
    probs = F.softmax(linear(x, router).float(), dim=-1)  # [T, E]
    w, ids = torch.topk(probs, k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(x.dtype), ids


class Experts(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/w [T, k] -> sum over k of w * expert_ids(x), [T, H]."""


class ResidentExperts:
    """All experts held in memory as stored (stacked [E, ...] QTensors per layer)."""

    def __init__(self, gate: dict[int, QTensor], up: dict[int, QTensor], down: dict[int, QTensor]):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)  # tokens routed to e, and which of their k choices it was
            y = swiglu(x[tok], self.gate[layer][e], self.up[layer][e], self.down[layer][e])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out
