"""The home tier of routed experts: per (layer, expert) its gate, up and down weights as stored.

From a GGUF file the experts are stacked along the outermost dimension, so expert e's three tensors are
three contiguous slices of the memory map: the store hands out views, and a page-in is three copies.
`owned=True` copies each expert into one contiguous buffer of memory moerun owns (the page cache may
drop mmap pages at any time; DESIGN decision 10), pinned when a GPU will copy from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.quant.qtypes import QTensor


@dataclass(frozen=True)
class Expert:
    gate: QTensor  # [I, H]
    up: QTensor  # [I, H]
    down: QTensor  # [H, I]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @staticmethod
    def from_buffer(buf: torch.Tensor, like: Expert) -> Expert:
        """Views of one contiguous uint8 buffer laid out gate | up | down, shaped like `like`."""
        parts, off = [], 0
        for t in (like.gate, like.up, like.down):
            parts.append(QTensor.from_bytes(buf[off:off + t.nbytes], t.qtype, t.shape))
            off += t.nbytes
        return Expert(*parts)

    def copy_into(self, buf: torch.Tensor) -> None:
        off = 0
        for t in (self.gate, self.up, self.down):
            buf[off:off + t.nbytes].copy_(t.data.reshape(-1), non_blocking=buf.is_cuda)
            off += t.nbytes


class ExpertStore:
    def __init__(self, gate: dict[int, QTensor], up: dict[int, QTensor], down: dict[int, QTensor],
                 owned: bool = False, pin: bool = False):
        self._stacks = {layer: (gate[layer], up[layer], down[layer]) for layer in gate}
        self._owned: dict[int, torch.Tensor] = {}
        if owned:
            for layer in self._stacks:
                E, nbytes = self.n_experts(layer), self.expert_bytes(layer)
                buf = torch.empty((E, nbytes), dtype=torch.uint8, pin_memory=pin)
                for e in range(E):
                    self._view(layer, e).copy_into(buf[e])
                self._owned[layer] = buf
        # Every expert's views, built once: the decode loop asks for k of them per layer and token.
        self._experts = {layer: [self._build(layer, e) for e in range(self.n_experts(layer))]
                         for layer in self._stacks}

    @property
    def layers(self) -> list[int]:
        return sorted(self._stacks)

    def n_experts(self, layer: int) -> int:
        return self._stacks[layer][0].shape[0]

    def expert_bytes(self, layer: int) -> int:
        return sum(t.nbytes // t.shape[0] for t in self._stacks[layer])

    def _view(self, layer: int, e: int) -> Expert:
        g, u, d = self._stacks[layer]
        return Expert(g[e], u[e], d[e])

    def _build(self, layer: int, e: int) -> Expert:
        if layer in self._owned:
            return Expert.from_buffer(self._owned[layer][e], self._view(layer, e))
        return self._view(layer, e)

    def get(self, layer: int, e: int) -> Expert:
        return self._experts[layer][e]

    @property
    def total_bytes(self) -> int:
        return sum(self.expert_bytes(layer) * self.n_experts(layer) for layer in self._stacks)
