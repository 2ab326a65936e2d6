"""How often each expert of each layer was used lately: a count per (layer, expert) that decays by half every
`half_life` steps of its layer, and the count since the start.

    use = ExpertUse(half_life=64)
    use.record(layer, experts)        # one step's distinct experts at one layer: O(len(experts))
    use.recent(layer)                 # [decayed count per expert], 1.0 for an expert the last step used alone

The decay costs nothing per step: instead of shrinking every count, each step adds a weight that grows by
2**(1/half_life), and a reading divides by the current weight (counts are rescaled, O(experts), when the
weight passes 2**64). Recorded from the forward thread; read from any (a reading is a copy).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

_RESCALE_AT = 2.0**64


class _Layer:
    """One layer's counts: decayed (in units of the current weight) and since the start."""

    __slots__ = ("decayed", "steps", "total", "weight")

    def __init__(self, n: int):
        self.weight = 1.0
        self.decayed = [0.0] * n
        self.total = [0] * n
        self.steps = 0


class ExpertUse:
    """Per layer: each expert's steps, decayed (half-life in the layer's steps) and since the start."""

    def __init__(self, n_experts: dict[int, int] | None = None, half_life: float = 64.0):
        """n_experts: experts per layer, known up front (others are sized at their first record)."""
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.half_life = half_life
        self._growth = 2.0 ** (1.0 / half_life)
        self._layers: dict[int, _Layer] = {layer: _Layer(n) for layer, n in (n_experts or {}).items()}
        self._lock = threading.Lock()  # a rescale against a reading

    def record(self, layer: int, experts: Iterable[int]) -> None:
        """One step of `layer` used `experts` (distinct ids)."""
        lay = self._layers.get(layer)
        if lay is None:
            experts = list(experts)
            lay = self._layers[layer] = _Layer(max(experts, default=-1) + 1)
        w, decayed, total = lay.weight, lay.decayed, lay.total
        for e in experts:
            if e >= len(total):
                self._grow(lay, e + 1)
                decayed, total = lay.decayed, lay.total
            decayed[e] += w
            total[e] += 1
        lay.steps += 1
        lay.weight = w * self._growth
        if lay.weight > _RESCALE_AT:
            with self._lock:
                w = lay.weight
                lay.decayed = [x / w if x > w * 1e-30 else 0.0 for x in lay.decayed]
                lay.weight = 1.0

    @staticmethod
    def _grow(lay: _Layer, n: int) -> None:
        lay.decayed = lay.decayed + [0.0] * (n - len(lay.decayed))
        lay.total = lay.total + [0] * (n - len(lay.total))

    def layers(self) -> list[int]:
        return sorted(self._layers)

    def recent(self, layer: int) -> list[float]:
        """Each expert's decayed count: the steps that used it, each weighted 2**(-age / half_life) where
        age is the steps of the layer since."""
        lay = self._layers.get(layer)
        if lay is None:
            return []
        with self._lock:
            scale = self._growth / lay.weight  # the last step's weight counts 1
            return [x * scale for x in lay.decayed]

    def total(self, layer: int) -> list[int]:
        """Each expert's steps since the start."""
        lay = self._layers.get(layer)
        return [] if lay is None else list(lay.total)

    def steps(self, layer: int) -> int:
        """Steps recorded at `layer`."""
        lay = self._layers.get(layer)
        return 0 if lay is None else lay.steps
