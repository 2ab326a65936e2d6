"""TritonOps: quantized weights multiplied by the Triton kernels (moerun.kernels.triton_q).

A call goes to the kernels when its weights are QTensors of a type they read, on the activations'
device, and that device can run them now (CUDA, or the CPU under TRITON_INTERPRET=1); anything else
(float weights, other types, a CPU tensor on a GPU machine, no triton) falls back to ReferenceOps.
Routed experts (plain SwiGLU, or gpt-oss's clamped one with biases) always go to the kernels when their
weights do: an experts mapping is checked once, when its ExpertTable is built (moe_table, or per call).
`device_ops` picks a stage's ops for its device (TritonOps on a GPU, else ops.make_ops); ops.py does not import
this module.
"""

from __future__ import annotations

import os

import torch

from moerun.experts.store import Expert
from moerun.model.ops import PLAIN, ExpertFn, ReferenceOps, Weight, make_ops
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
                   and w.data.device == x.device and w.data.is_contiguous() for w in ws)

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() >= 1 and self._ok(x, w):
            y = self.tq.matmul(x.reshape(-1, x.shape[-1]), w, bias=b)
            return y.reshape(*x.shape[:-1], w.shape[0])
        return super().linear(x, w, b)

    def linears(self, x: torch.Tensor, ws: list[Weight], bs: list | None = None) -> list[torch.Tensor]:
        """One launch for weights of one type and K (q|k|v, gate|up) and no biases: views of one [T, sum N]
        result."""
        if (x.dim() == 2 and len(ws) > 1 and self._ok(x, *ws) and len({w.qtype for w in ws}) == 1
                and len({w.shape[1] for w in ws}) == 1 and (bs is None or all(b is None for b in bs))):
            return list(self.tq.matmul_multi(x, ws).split([w.shape[0] for w in ws], 1))
        return super().linears(x, ws, bs)

    def swiglu(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
        if x.dim() == 2 and self._ok(x, gate, up, down):
            return self.tq.swiglu(x, gate, up, down)
        return super().swiglu(x, gate, up, down)

    def moe_table(self, experts: dict[int, Expert]):
        """The kernels' address tables and id lookup for experts that stay where they are, built and checked
        once (None where the kernels do not take them)."""
        first = next(iter(experts.values()), None)
        if first is None or not isinstance(first.gate, QTensor) or not self.tq.runs_on(first.gate.data.device):
            return None
        if not all(isinstance(q, QTensor) and self.tq.supports(q.qtype) for q in (first.gate, first.up, first.down)):
            return None
        try:
            return self.tq.ExpertTable(experts)
        except ValueError:  # experts of mixed types or shapes, or not contiguous
            return None

    def _table(self, x: torch.Tensor, experts: dict[int, Expert], table, fn: ExpertFn):
        """The ExpertTable this call runs with, or None for ReferenceOps' loop."""
        if x.dim() != 2 or fn.act not in self.tq.ACTS or not (x.is_floating_point() and self.tq.runs_on(x.device)):
            return None
        if table is None:
            table = self.moe_table(experts)
        return table if table is not None and getattr(table, "dev", None) == x.device else None

    def moe(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[int, Expert],
            table=None, *, fn: ExpertFn = PLAIN) -> torch.Tensor:
        tab = self._table(x, experts, table, fn)
        if tab is not None:
            return self.tq.moe_ffn(x, ids, w, experts, table=tab, fn=None if fn.plain else fn)
        return super().moe(x, ids, w, experts, fn=fn)

    def moe_pairs(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: dict[int, Expert],
                  out: torch.Tensor | None = None, *, fn: ExpertFn = PLAIN) -> torch.Tensor:
        tab = self._table(x, experts, None, fn)
        if tab is not None:
            res = self.tq.moe_ffn(x, ids, w, experts, pairs=True, table=tab, fn=None if fn.plain else fn)
            return res if out is None else out.copy_(res)
        return super().moe_pairs(x, ids, w, experts, out, fn=fn)


STANDIN_KERNELS_ENV = "MOERUN_STANDIN_KERNELS"  # "triton": the stand-in device runs the Triton kernels (interpreted)


def device_ops(dev, kernels: bool = True) -> ReferenceOps:
    """How a stage on `dev` (moerun.device.Device) multiplies its weights: the Triton kernels on a GPU
    (reference for what they do not take); on the CPU stand-in the host's kernels, or with
    MOERUN_STANDIN_KERNELS=triton (and TRITON_INTERPRET=1) the Triton kernels in triton's interpreter."""
    if dev.kind == "cuda" or (dev.kind == "standin" and os.environ.get(STANDIN_KERNELS_ENV) == "triton"):
        return TritonOps() if kernels else ReferenceOps()
    return make_ops(kernels)
