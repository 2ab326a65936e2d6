"""Expert cache: fixed slots per layer on one compute device, over the home-tier ExpertStore.

A step asks for the distinct experts its tokens were routed to. Residents hit; a miss either pages the
expert into a slot (one contiguous buffer per slot, three copies) evicting the policy's victim, or is
computed where it lives (a bypass: when every slot is pinned by the same step, or during prefill when
`prefill="bypass"` keeps a long prompt from evicting the decode working set wholesale).
"""

from __future__ import annotations

import time

import torch

from moerun.experts.policy import SlotTable
from moerun.experts.stats import CacheStats
from moerun.experts.store import Expert, ExpertStore

PREFILL_MODES = ("bypass", "cache")


class ExpertCache:
    def __init__(self, store: ExpertStore, slots: int | dict[int, int], policy: str = "lru",
                 device: str | torch.device = "cpu", prefill: str = "bypass", stats: CacheStats | None = None):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {prefill!r}")
        self.store, self.device, self.prefill = store, torch.device(device), prefill
        self.stats = stats or CacheStats()
        per_layer = slots if isinstance(slots, dict) else dict.fromkeys(store.layers, slots)
        self.tables: dict[int, SlotTable] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        for layer in store.layers:
            n = min(per_layer.get(layer, 0), store.n_experts(layer))
            if n > 0:
                self.tables[layer] = SlotTable(n, policy)
                self.buffers[layer] = torch.empty((n, store.expert_bytes(layer)), dtype=torch.uint8,
                                                  device=self.device)
        self._slots = {layer: [Expert.from_buffer(buf[i], store.get(layer, 0)) for i in range(len(buf))]
                       for layer, buf in self.buffers.items()}  # each slot's views, built once

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def slots(self, layer: int) -> int:
        t = self.tables.get(layer)
        return 0 if t is None else t.slots

    def _slot(self, layer: int, slot: int) -> Expert:
        return self._slots[layer][slot]

    def fetch(self, layer: int, experts: list[int], phase: str) -> dict[int, Expert]:
        """expert id -> its weights for this step: a slot's views for hits and loads, home views for bypasses."""
        table = self.tables.get(layer)
        if table is None:  # no slots for this layer: everything is computed at home
            self.stats.record_step(layer, phase, hits=0, misses=len(set(experts)))
            return {e: self.store.get(layer, e) for e in experts}
        t0 = time.perf_counter()
        plan = table.request(experts, bypass_misses=phase == "prefill" and self.prefill == "bypass")
        paged = 0
        for load in plan.loads:
            src = self.store.get(layer, load.expert)
            src.copy_into(self.buffers[layer][load.slot])
            paged += src.nbytes
        stalled = time.perf_counter() - t0 if plan.loads else 0.0
        self.stats.record_step(layer, phase, hits=len(plan.hits), misses=plan.misses,
                               evictions=plan.evictions, bytes_paged_in=paged, seconds_stalled=stalled)
        out = {e: self._slot(layer, table.slot_of(e)) for e in (*plan.hits, *(ld.expert for ld in plan.loads))}
        out |= {e: self.store.get(layer, e) for e in plan.bypassed}
        return out
