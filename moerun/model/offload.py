"""The routed experts of a device stage (DESIGN decision 13): the MoE block when dense weights are on a GPU
(or its CPU stand-in) and the experts' home is host RAM or the file.

Per MoE layer and step:

    ids, w, x -> host                       the one synchronisation: the router's choices come back
    need = {expert: tokens routed to it}
    placement = cache.place(need, choose)   hits; misses paged into slots (copy stream) or streamed (prefill)
                                            or computed at home, as the cost model (`choose`) says
    pairs  = device: hits                   [T*k, H], one weighted row per (token, choice)
           + device: page-ins               after their copies (an event on the compute stream)
           + device: streamed chunks        through the double buffer
           + host:   home misses            the CPU kernels, while the device works; rows uploaded
    out    = sum_pairs(pairs)               in choice order, so where a pair ran never changes the result

Layers whose experts the plan keeps on the CPU (--n-cpu-moe, -ot exps=CPU) compute every expert at home;
layers whose experts all fit on the device hold them there (no cache, no synchronisation).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from moerun import device
from moerun.experts.cache import ExpertCache
from moerun.experts.store import Expert, ExpertStore
from moerun.model.ops import PLAIN, ExpertFn, ReferenceOps, sum_pairs

MISS_MODES = ("auto", "fetch", "home")  # the cost model's choice, or every miss paged in / computed at home


class DeviceExperts:
    """A device stage's expert source: `run` computes a layer's routed experts (module docstring).

    store: the home tier (host). cache: slots on the device for the layers it has tables for (may be None);
    resident: layer -> every expert's weights on the device; home_layers: computed on the CPU only.
    choose(layer, expert, tokens) -> "fetch" | "home" for a miss."""

    def __init__(self, dev: device.Device, ops: ReferenceOps, home_ops: ReferenceOps, store: ExpertStore,
                 cache: ExpertCache | None, choose: Callable[[int, int, int], str],
                 resident: dict[int, dict[int, Expert]] | None = None, home_layers: set[int] = frozenset(),
                 pinned: list | None = None):
        self.dev, self.ops, self.home_ops, self.store, self.cache = dev, ops, home_ops, store, cache
        self.choose, self.resident, self.home_layers = choose, resident or {}, set(home_layers)
        self._pinned = pinned or []  # page-locked regions of the home tier: kept as long as copies read them
        self._tables: dict[int, object] = {}  # resident layers' prebuilt kernel tables (Triton), by layer
        self._host_fns: dict[int, ExpertFn] = {}  # layers' expert biases copied to the host, for home misses

    prefetching = False

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, phase: str,
            fn: ExpertFn = PLAIN) -> torch.Tensor:
        """x [T, H], ids / w [T, k] on the device -> the routed experts' output [T, H] on the device. fn: the
        experts' activation and biases (on the device; the host's copy for home misses). A negative id is a
        pair this source does not compute (another rank's under expert parallelism, moerun.model.shards): 0."""
        if layer in self.resident:
            if layer not in self._tables:
                self._tables[layer] = self.ops.moe_table(self.resident[layer])
            return self.ops.moe(x, ids, w, self.resident[layer], table=self._tables[layer], fn=fn)
        x_h, ids_h, w_h = device.to_host([x, ids, w], dev=self.dev)  # the step's one wait for the device
        need = Counter(e for e in ids_h.view(-1).tolist() if e >= 0)
        if layer in self.home_layers or self.cache is None:
            home = {e: self.store.get(layer, e) for e in sorted(need)}
            with device.on_host(self.dev):
                out = self.home_ops.moe(x_h.float().contiguous(), ids_h, w_h, home, fn=self._host_fn(layer, fn))
            return device.upload(out, self.dev).to(x.dtype)
        return self._hybrid(layer, x, ids, w, x_h, ids_h, w_h, need, phase, fn)

    def _host_fn(self, layer: int, fn: ExpertFn) -> ExpertFn:
        """fn with its biases in host memory (copied once per layer)."""
        if fn.biases is None or fn.biases[0].is_cpu:
            return fn
        if layer not in self._host_fns:
            self._host_fns[layer] = fn.to(torch.device("cpu"))
        return self._host_fns[layer]

    def _hybrid(self, layer, x, ids, w, x_h, ids_h, w_h, need, phase, fn) -> torch.Tensor:
        T, k = ids.shape
        cache, ops = self.cache, self.ops
        pl = cache.place(layer, dict(need), phase, lambda e, n: self.choose(layer, e, n))
        pairs = torch.zeros(T * k, x.shape[1], dtype=torch.float32, device=x.device)  # [T*k, H]
        if pl.on_device:
            pairs += ops.moe_pairs(x, ids, w, pl.on_device, fn=fn)
        if pl.paged:
            cache.wait_ready(pl, layer, phase)
            pairs += ops.moe_pairs(x, ids, w, pl.paged, fn=fn)
        for chunk in cache.stream(layer, pl.streamed, phase):
            pairs += ops.moe_pairs(x, ids, w, chunk, fn=fn)
        cache.computed(layer)
        if pl.home:  # on the CPU while the device works through what was queued above
            with device.on_host(self.dev):
                rows = device.pinned_empty(T * k * x.shape[1] * 4, self.dev).view(torch.float32).view(T * k, -1)
                self.home_ops.moe_pairs(x_h.float().contiguous(), ids_h, w_h, pl.home, out=rows,
                                        fn=self._host_fn(layer, fn))
            pairs += device.upload(rows, self.dev)
        return sum_pairs(pairs, k).to(x.dtype)
