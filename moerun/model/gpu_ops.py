"""TritonOps: quantized weights multiplied by the Triton kernels (moerun.kernels.triton_q).

A call goes to the kernels when its weights are QTensors of a type they read, on the activations'
device, and that device can run them now (CUDA, or the CPU under TRITON_INTERPRET=1); anything else
(float weights, other types, a CPU tensor on a GPU machine, no triton) falls back to ReferenceOps.
"""

from __future__ import annotations

import torch

from moerun.experts.store import Expert
from moerun.model.ops import PLAIN, ExpertFn, ReferenceOps, Weight
from moerun.quant.qtypes import QTensor


class TritonOps(ReferenceOps):
    name = "triton"

    def __init__(self):
        from moerun.kernels import triton_q

        super().__init__()
        self.tq = triton_q

    def _ok(self, x: torch.Tensor, *ws: Weight) -> bool:
        if not (x.is_floating_point() and self.tq.runs_on(x.device)):
            return False
        return all(isinstance(w, QTensor) and len(w.shape) == 2 and self.tq.supports(w.qtype)
                   and w.data.device == x.device for w in ws)

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() >= 1 and self._ok(x, w):
            y = self.tq.matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
            return y if b is None else y + b
        return super().linear(x, w, b)

    def swiglu(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
        if x.dim() == 2 and self._ok(x, gate, up, down):
            return self.tq.swiglu(x, gate, up, down)
        return super().swiglu(x, gate, up, down)

    def _moe_ok(self, x: torch.Tensor, experts: dict[int, Expert]) -> bool:
        first = next(iter(experts.values()), None)
        return x.dim() == 2 and first is not None and len({_kind(e) for e in experts.values()}) == 1 and \
            self._ok(x, first.gate, first.up, first.down)

    def moe_table(self, experts: dict[int, Expert]):
        """The kernels' address table and id lookup for experts that stay where they are, built once."""
        first = next(iter(experts.values()), None)
        if first is None or not self.tq.runs_on(first.gate.data.device) or len({_kind(e) for e in experts.values()}) != 1:
            return None
        return self.tq.ExpertTable(experts)

    def moe(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[int, Expert],
            table=None, *, fn: ExpertFn = PLAIN) -> torch.Tensor:
        if fn.plain and self._moe_ok(x, experts):
            return self.tq.moe_ffn(x, ids, w, experts, table=table)
        return super().moe(x, ids, w, experts, fn=fn)  # other activations: each expert's matmuls here

    def moe_pairs(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[int, Expert],
                  out: torch.Tensor | None = None, *, fn: ExpertFn = PLAIN) -> torch.Tensor:
        if fn.plain and self._moe_ok(x, experts):
            res = self.tq.moe_ffn(x, ids, w, experts, pairs=True)
            return res if out is None else out.copy_(res)
        return super().moe_pairs(x, ids, w, experts, out, fn=fn)


def _kind(e: Expert) -> tuple:
    """What the kernels need all experts of a call to share: type, shape and device of gate, up, down."""
    return tuple((q.qtype, q.shape, q.data.device) if isinstance(q, QTensor) else type(q)
                 for q in (e.gate, e.up, e.down))
